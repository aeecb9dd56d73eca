// The Files panel of a session's workspace screen: browse the workspace (or home), download a file
// (or a directory as a tar), upload by picking or dropping files into the folder shown. Every call
// is an access, so the panel loads only when opened. Loaded before app.js, whose helpers (API, api,
// request, h) it uses when called.
// Names come from the session (its listing), so no URL is built from one unchecked: each segment
// must be one file name (no "/", NUL or control character, not "." or "..", which a browser would
// resolve, and so move the request to another path, even to another session) and is then
// percent-encoded.
"use strict";

function isEntryName(name) {
  return typeof name === "string" && name !== "" && name !== "." && name !== ".." &&
    !/[/\x00-\x1f\x7f-\x9f]/.test(name);
}

function encodePath(path) {
  return path.split("/").filter(Boolean).map((part) => {
    if (!isEntryName(part)) throw new Error(`refused: ${JSON.stringify(part)} is not a file name`);
    return encodeURIComponent(part);
  }).join("/");
}

function joinPath(...parts) {
  return parts.filter(Boolean).join("/");
}

function fileSize(bytes) {
  if (bytes < 1024) return `${bytes} B`;
  if (bytes < 1048576) return `${(bytes / 1024).toFixed(1)} KiB`;
  if (bytes < 1073741824) return `${(bytes / 1048576).toFixed(1)} MiB`;
  return `${(bytes / 1073741824).toFixed(1)} GiB`;
}

function filesPanel(id) {
  const state = { root: "workspace", path: "" };
  const query = () => (state.root === "workspace" ? "" : `?root=${state.root}`);
  const fileUrl = (path) => `${API}/sessions/${id}/files/${encodePath(path)}${query()}`;

  const crumbs = h("span", { class: "crumbs", "data-test": "files-path" });
  const rows = h("tbody", { "data-test": "files-entries" });
  const note = h("div", { class: "statusline", "data-test": "files-status" });
  const picker = h("input", { type: "file", multiple: true, hidden: true, "data-test": "files-picker",
                              onchange: () => { upload(picker.files); picker.value = ""; } });
  const root = h("select", { "data-test": "files-root", onchange: () => { state.root = root.value; go(""); } },
                 h("option", { value: "workspace" }, "workspace"), h("option", { value: "home" }, "home"));
  const drop = h("div", { class: "files-drop", "data-test": "files-drop" },
                 h("table", {}, h("thead", {}, h("tr", {}, ...["Name", "Size", "Mode", "Modified", ""].map((t) => h("th", {}, t)))), rows),
                 h("div", { class: "muted files-hint" }, "Drop files here to upload them into this folder."));
  const panel = h("details", { class: "files", "data-test": "files",
                               ontoggle: () => { if (panel.open) load(); } },
    h("summary", {}, "Files"),
    h("div", { class: "toolbar files-toolbar" }, root, crumbs, h("span", { class: "spacer" }),
      h("button", { "data-test": "files-upload", onclick: () => picker.click() }, "Upload…"),
      h("button", { "data-test": "files-refresh", onclick: () => load() }, "Refresh"), picker),
    drop, note);

  for (const kind of ["dragenter", "dragover"]) {
    drop.addEventListener(kind, (event) => { event.preventDefault(); drop.classList.add("over"); });
  }
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    upload(event.dataTransfer.files);
  });

  function go(path) { state.path = path; load(); }

  async function load() {
    try {
      const listing = await api("GET", `/sessions/${id}/list/${encodePath(state.path)}${query()}`);
      render(listing);
      note.textContent = listing.truncated ? `showing the first ${listing.entries.length} entries` : "";
    } catch (e) { note.textContent = e.message; }
  }

  function render(listing) {
    const parts = state.path.split("/").filter(Boolean);
    crumbs.replaceChildren(h("a", { href: "#", onclick: (e) => { e.preventDefault(); go(""); } }, state.root),
      ...parts.flatMap((part, i) => [" / ", h("a", { href: "#", onclick: (e) => { e.preventDefault(); go(parts.slice(0, i + 1).join("/")); } }, part)]));
    const up = parts.length
      ? [h("tr", {}, h("td", { colspan: 5 }, h("a", { href: "#", "data-test": "files-up", onclick: (e) => { e.preventDefault(); go(parts.slice(0, -1).join("/")); } }, "..")))]
      : [];
    const entries = listing.entries || [];
    rows.replaceChildren(...up, ...entries.map((entry) => {
      const path = joinPath(state.path, entry.name);
      const usable = isEntryName(entry.name);
      let name;
      if (!usable) {
        name = h("span", { class: "error" }, `refused name ${JSON.stringify(entry.name)}`);
      } else if (entry.type === "directory") {
        name = h("a", { href: "#", "data-test": "files-dir", onclick: (e) => { e.preventDefault(); go(path); } }, `${entry.name}/`);
      } else if (entry.type === "file") {
        name = h("a", { href: "#", "data-test": "files-file", onclick: (e) => { e.preventDefault(); download(path, entry.name); } }, entry.name);
      } else {
        name = h("span", { class: "muted" }, entry.name + (entry.target ? ` → ${entry.target}` : ` (${entry.type})`));
      }
      const tar = usable && entry.type === "directory"
        ? h("a", { href: "#", class: "muted", title: "download as a tar",
                   onclick: (e) => { e.preventDefault(); download(path, `${entry.name}.tar`); } }, "tar") : "";
      return h("tr", { "data-entry": entry.name },
        h("td", {}, name),
        h("td", { class: "muted" }, entry.type === "file" ? fileSize(entry.size) : ""),
        h("td", { class: "muted" }, entry.mode.toString(8).padStart(4, "0")),
        h("td", { class: "muted" }, new Date(entry.mtime * 1000).toLocaleString()),
        h("td", { class: "files-tar" }, tar));
    }));
    if (!entries.length) rows.append(h("tr", {}, h("td", { colspan: 5, class: "empty" }, "Empty folder.")));
  }

  // A download carries the credential, so it is fetched here and handed to the browser whole.
  async function download(path, name) {
    note.textContent = `downloading ${name}…`;
    try {
      const blob = await (await request(fileUrl(path))).blob();
      const link = h("a", { href: URL.createObjectURL(blob), download: name, hidden: true });
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(link.href), 60000);
      note.textContent = "";
    } catch (e) { note.textContent = `${name}: ${e.message}`; }
  }

  // Each file is streamed as the request body (no base64, no reading it whole here).
  async function upload(files) {
    for (const file of Array.from(files)) {
      note.textContent = `uploading ${file.name} (${fileSize(file.size)})…`;
      try {
        await request(fileUrl(joinPath(state.path, file.name)), {
          method: "PUT", headers: { "Content-Type": "application/octet-stream" }, body: file });
      } catch (e) { note.textContent = `${file.name}: ${e.message}`; await load(); return; }
    }
    await load();
    note.textContent = `uploaded ${Array.from(files).map((f) => f.name).join(", ")}`;
  }

  return panel;
}
