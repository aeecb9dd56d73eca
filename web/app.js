// Reploy's session UI: a small single-page app over /api/v1 (see openapi.json: seed 002's API and
// Reploy's additions). No build step. Screens: sessions list (#/), new session (#/new),
// workspace (#/s/<id>): a terminal for shell sessions, a prompt and live transcript for
// claude-code sessions, and a restore screen for snapshotted ones. Output arrives over the
// passive SSE stream; opening a workspace is an explicit access (POST /switch), which resumes an
// idle session.
// Credentials: `reploy serve`'s login_url carries the token in its fragment (/#token=...),
// which no server and no Referer ever sees. This script moves it into this tab's
// sessionStorage (scoped to this scheme, host and port: no other port of the host can read it),
// clears the address bar, and sends it as `Authorization: Bearer` on every request, the stream
// included (read with fetch). Nothing lives in a cookie, so nothing reaches another port of the
// host. "Log out" forgets it; any 401 replaces the screen with a note to open the login URL.
"use strict";

const API = "/api/v1";
const POLL_MS = 2000;
const STATUS_POLL_MS = 1000;
const TOKEN_KEY = "reploy-token";
const TOKEN_FRAGMENT = "#token=";

// ---- credentials ----------------------------------------------------------------------------

// The login URL's token into sessionStorage, and out of the address bar and the tab's history.
function takeTokenFromAddress() {
  if (!location.hash.startsWith(TOKEN_FRAGMENT)) return;
  const token = decodeURIComponent(location.hash.slice(TOKEN_FRAGMENT.length));
  history.replaceState(null, "", location.pathname);
  if (/^[A-Za-z0-9._~+/=-]{32,512}$/.test(token)) sessionStorage.setItem(TOKEN_KEY, token);
}

function authorized(init = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return { ...init, headers: { ...(init.headers || {}), ...(token ? { Authorization: `Bearer ${token}` } : {}) } };
}

function logOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  loginScreen();
}

// ---- helpers --------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(message, status) { super(message); this.status = status; }
}

// One request with the credential: a 401 shows the login screen, an error status throws
// ApiError with the server's message.
async function request(url, init) {
  const response = await fetch(url, authorized(init));
  if (response.status === 401) loginScreen();
  if (!response.ok) {
    let doc = {};
    try { doc = await response.json(); } catch (_) { doc = { error: response.statusText }; }
    throw new ApiError(doc.error || response.statusText, response.status);
  }
  return response;
}

// One JSON call: its answer's document, or null for an answer without one (a delete's 204).
async function api(method, path, body) {
  const response = await apiResponse(method, path, body);
  if (response.status === 204) return null;
  try { return await response.json(); } catch (_) { return { error: response.statusText }; }
}

async function apiResponse(method, path, body) {
  const init = { method, headers: {} };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  return request(API + path, init);
}

function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== undefined && value !== null && value !== false) node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function base64ToBytes(b64) {
  const text = atob(b64);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return bytes;
}

// A Session's date-time (RFC 3339) in Unix seconds.
function when(stamp) { return Date.parse(stamp) / 1000; }

function ago(seconds) {
  seconds = Math.max(0, Math.round(seconds));
  if (seconds < 60) return `${seconds}s ago`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)}m ago`;
  return `${Math.floor(seconds / 3600)}h ago`;
}

function clock(seconds) {
  seconds = Math.max(0, Math.round(seconds));
  const m = Math.floor(seconds / 60), s = seconds % 60;
  return m >= 60 ? `${Math.floor(m / 60)}h${String(m % 60).padStart(2, "0")}m` : `${m}:${String(s).padStart(2, "0")}`;
}

// Reads a server-sent event stream with fetch (EventSource cannot send the credential): on(type,
// data) for each event, onEnd(error or null) once it ends by itself. close() ends it quietly.
// The stream is serve's own format: "\n"-ended lines, `event:` and `data:` fields, comments.
function openStream(url, on, onEnd) {
  const abort = new AbortController();
  (async () => {
    try {
      const response = await fetch(url, authorized({ signal: abort.signal, headers: { Accept: "text/event-stream" } }));
      if (response.status === 401) loginScreen();
      if (!response.ok || !response.body) throw new ApiError(`the stream answered ${response.status}`, response.status);
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "", type = "message", data = [];
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, end).replace(/\r$/, "");
          buffer = buffer.slice(end + 1);
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (line === "") {
            if (data.length) on(type, data.join("\n"));
            type = "message";
            data = [];
          } else if (field === "event") type = text;
          else if (field === "data") data.push(text);
        }
      }
      if (!abort.signal.aborted) onEnd(null);
    } catch (e) { if (!abort.signal.aborted) onEnd(e); }
  })();
  return { close: () => abort.abort() };
}

function badge(state) { return h("span", { class: `badge ${state}`, "data-test": "state" }, state); }

// The last snapshot or restore that failed (lastFailure), as text: why, how often, and when the
// reaper tries a snapshot again. Null when the last one succeeded.
function failureText(s) {
  const failure = s.lastFailure;
  if (!failure) return null;
  const times = failure.failures > 1 ? ` (${failure.failures} in a row)` : "";
  const retry = failure.retryAt ? `; tried again from ${new Date(failure.retryAt).toLocaleString()}` : "";
  return `${failure.step} failed${times}: ${failure.reason}${retry}`;
}

function failureNote(s) {
  const text = failureText(s);
  return text && h("div", { class: "error", "data-test": "last-failure" }, text);
}

// ---- router ---------------------------------------------------------------------------------

const view = document.getElementById("view");
let teardown = null;
let loggedOut = false; // once the API said 401, only the login note shows

function show(...nodes) { if (!loggedOut) view.replaceChildren(...nodes); }

// The API needs the token: stop the current screen and say how to give it.
function loginScreen() {
  if (teardown) { teardown(); teardown = null; }
  if (loggedOut) return;
  loggedOut = true;
  view.replaceChildren(h("div", { class: "login", "data-test": "login-screen" },
    h("h1", {}, "Log in"),
    h("p", {}, "Open the login URL printed by ", h("code", {}, "reploy serve"),
      " (the login_url of its start line) in this tab."),
    h("p", { class: "muted" }, "It is this server's address followed by /#token= and the " +
      "token in the server's state directory (STATE_DIR/token). The token stays in this tab only.")));
}

function route() {
  if (teardown) { teardown(); teardown = null; }
  takeTokenFromAddress();
  loggedOut = false; // navigating tries again (the login URL may have been opened meanwhile)
  const hash = location.hash || "#/";
  const session = hash.match(/^#\/s\/([0-9a-f]{16})$/);
  for (const link of document.querySelectorAll("[data-nav]")) {
    link.classList.toggle("current", link.dataset.nav === (hash === "#/new" ? "new" : session ? "" : "sessions"));
  }
  if (hash === "#/new") newSessionScreen();
  else if (session) workspaceScreen(session[1]);
  else sessionsScreen();
}

window.addEventListener("hashchange", route);
document.querySelector("[data-test=logout]").addEventListener("click", logOut);

// ---- sessions list --------------------------------------------------------------------------

function sessionsScreen() {
  const body = h("tbody");
  const error = h("div", { class: "error" });
  let skew = 0, sessions = [], stopped = false;
  const confirming = new Set();

  function countdown(s) {
    const now = Date.now() / 1000 + skew;
    if (s.phase) return `${s.phase}…`;
    if (s.idleBlockedBy && s.idleBlockedBy.length) return `held: ${s.idleBlockedBy.join(", ")}`;
    if (s.state === "active" && s.idleAt) return `idle in ${clock(when(s.idleAt) - now)}`;
    if (s.state === "idle" && s.snapshotAt) return `snapshot in ${clock(when(s.snapshotAt) - now)}`;
    return "—";
  }

  function draw() {
    const now = Date.now() / 1000 + skew;
    if (!sessions.length) {
      body.replaceChildren(h("tr", {}, h("td", { colspan: 7, class: "empty" }, "No sessions yet. ", h("a", { href: "#/new" }, "Create one."))));
      return;
    }
    body.replaceChildren(...sessions.map((s) => {
      const del = confirming.has(s.id)
        ? [h("button", { class: "danger confirm", "data-test": "confirm-delete", onclick: () => remove(s.id) }, "Confirm delete"),
           h("button", { onclick: () => { confirming.delete(s.id); draw(); } }, "Cancel")]
        : [h("button", { class: "danger", "data-test": "delete", onclick: () => { confirming.add(s.id); draw(); } }, "Delete")];
      return h("tr", { "data-session": s.id },
        h("td", {}, h("a", { href: `#/s/${s.id}`, "data-test": "open" }, s.name)),
        h("td", {}, s.workloadType + (s.model ? ` · ${s.model}` : "")),
        h("td", {}, badge(s.state)),
        h("td", { class: "muted" }, s.deployment),
        h("td", { class: "muted" }, ago(now - when(s.lastAccess))),
        h("td", { class: "muted", "data-test": "countdown", title: failureText(s) },
          countdown(s), s.lastFailure ? h("div", { class: "error", "data-test": "last-failure" }, `${s.lastFailure.step} failed`) : null),
        h("td", { class: "actions" }, ...del));
    }));
  }

  // The server's clock, for the countdowns, from its answer's Date header (to the second).
  async function refresh() {
    try {
      const response = await apiResponse("GET", "/sessions");
      const served = Date.parse(response.headers.get("Date"));
      if (!Number.isNaN(served)) skew = served / 1000 - Date.now() / 1000;
      sessions = (await response.json()).sessions || [];
      error.textContent = "";
    } catch (e) { error.textContent = e.message; }
    if (!stopped) draw();
  }

  async function remove(id) {
    confirming.delete(id);
    try { await api("DELETE", `/sessions/${id}`); } catch (e) { error.textContent = e.message; }
    refresh();
  }

  show(h("div", { class: "toolbar" }, h("h1", {}, "Sessions"), h("span", { class: "spacer" }),
         h("a", { class: "button", href: "#/new" }, "New session")),
       error,
       h("table", { "data-test": "sessions" },
         h("thead", {}, h("tr", {}, ...["Name", "Workload", "State", "Deployment", "Last access", "Idle countdown", ""].map((t) => h("th", {}, t)))),
         body));
  refresh();
  const poll = setInterval(refresh, POLL_MS);
  const tick = setInterval(draw, 1000);
  teardown = () => { stopped = true; clearInterval(poll); clearInterval(tick); };
}

// ---- new session ----------------------------------------------------------------------------

async function newSessionScreen() {
  const error = h("div", { class: "error", "data-test": "error" });
  const name = h("input", { name: "name", required: true, placeholder: "my-session", "data-test": "name" });
  const workload = h("select", { name: "workloadType", "data-test": "workload" },
                     h("option", { value: "shell" }, "shell"), h("option", { value: "claude-code" }, "claude-code"));
  const models = h("datalist", { id: "models" });
  const model = h("input", { name: "model", list: "models", placeholder: "platform default", "data-test": "model" });
  const modelField = h("label", { hidden: true }, "Model", model, models);
  const deployment = h("select", { name: "deployment", "data-test": "deployment" });
  const submit = h("button", { class: "primary", type: "submit", "data-test": "create" }, "Create session");
  workload.addEventListener("change", () => { modelField.hidden = workload.value !== "claude-code"; });

  const form = h("form", { class: "form", onsubmit: async (event) => {
    event.preventDefault();
    submit.disabled = true;
    error.textContent = "";
    const body = { name: name.value.trim(), workloadType: workload.value };
    if (workload.value === "claude-code" && model.value.trim()) body.model = model.value.trim();
    if (deployment.value) body.deployment = deployment.value;
    try {
      submit.textContent = "Starting…";
      const session = await api("POST", "/sessions", body);
      location.hash = `#/s/${session.id}`;
    } catch (e) {
      error.textContent = e.message;
      submit.disabled = false;
      submit.textContent = "Create session";
    }
  } },
    h("label", {}, "Name", name), h("label", {}, "Workload type", workload), modelField,
    h("label", {}, "Deployment", deployment), submit, error);
  show(h("h1", {}, "New session"), form);
  try {
    const [config, server] = await Promise.all([api("GET", "/config"), api("GET", "/server")]);
    deployment.replaceChildren(...server.deployments.map((d) => h("option", { value: d }, d)));
    models.replaceChildren(...config.claudeCode.models.map((m) => h("option", { value: m })));
    model.placeholder = `${config.claudeCode.defaultModel} (platform default)`;
  } catch (e) { error.textContent = e.message; }
}

// ---- workspace ------------------------------------------------------------------------------

async function workspaceScreen(id) {
  let closed = false;
  const cleanups = [];
  teardown = () => { closed = true; cleanups.forEach((f) => f()); };
  let session;
  try {
    session = await api("GET", `/sessions/${id}`);
  } catch (e) {
    show(h("h1", {}, "Session"), h("div", { class: "error" }, e.message), h("a", { href: "#/" }, "Back to sessions"));
    return;
  }
  if (closed) return;
  if (session.phase) { // snapshotting or restoring: wait for it to end
    show(h("h1", {}, session.name), h("p", { class: "muted" }, `The session is ${session.phase}…`));
    const again = setTimeout(() => { if (!closed) route(); }, 500);
    cleanups.push(() => clearTimeout(again));
    return;
  }
  if (session.state === "snapshot") return restoreScreen(session);
  try {
    session = await api("POST", `/sessions/${id}/switch`, {}); // an access: resumes an idle session
  } catch (e) {
    show(h("h1", {}, session.name), h("div", { class: "error" }, e.message));
    return;
  }
  if (closed) return;

  const state = badge(session.state);
  const status = h("div", { class: "statusline", "data-test": "statusline" });
  const snapshot = h("button", { "data-test": "snapshot", onclick: async () => {
    snapshot.disabled = true;
    try { await api("POST", `/sessions/${id}/snapshot`, {}); route(); }
    catch (e) { status.textContent = e.message; snapshot.disabled = false; }
  } }, "Snapshot");
  const toolbar = h("div", { class: "toolbar" }, h("h1", {}, session.name), state,
                    h("span", { class: "muted" }, `${session.workloadType}${session.model ? " · " + session.model : ""} · ${session.deployment}`),
                    h("span", { class: "spacer" }), snapshot);
  const failure = h("div", { class: "error", "data-test": "last-failure" }, failureText(session) || "");
  toolbar.append(failure); // the views show the toolbar: the last failure goes with it

  // The session's state, polled passively: a snapshot taken meanwhile routes to restore.
  const poll = setInterval(async () => {
    try {
      const current = await api("GET", `/sessions/${id}`);
      state.className = `badge ${current.state}`;
      state.textContent = current.state;
      failure.textContent = failureText(current) || "";
      if (current.state === "snapshot" && !current.phase) route();
    } catch (e) { if (e.status === 404) location.hash = "#/"; }
  }, POLL_MS);
  cleanups.push(() => clearInterval(poll));

  const onOutput = session.workloadType === "shell" ? shellView(id, toolbar, status, cleanups) : agentView(id, toolbar, status, cleanups);
  view.append(filesPanel(id)); // web/files.js
  follow(id, onOutput, status, cleanups, () => closed);
}

// Follows the SSE stream; on `reset` it re-reads the log from 0 and reconnects from that read's
// cursor (seed 002). After a transport failure it looks at the session first: it reconnects only
// to an active or idle session, sends a snapshot to the restore screen, and while a snapshot or
// restore is under way (`phase`) it waits for it to end instead of reconnecting.
function follow(id, sink, status, cleanups, isClosed) {
  let source = null, cursor = 0, retry = null;
  const later = (step, ms) => { clearTimeout(retry); retry = setTimeout(() => { if (!isClosed()) step(); }, ms); };
  const recover = async () => {
    let current;
    try {
      current = await api("GET", `/sessions/${id}`);
    } catch (e) {
      if (e.status === 404) { location.hash = "#/"; return; }
      status.textContent = `reconnecting: ${e.message}`;
      later(recover, 1000);
      return;
    }
    if (isClosed()) return;
    if (current.phase) {
      status.textContent = `waiting for the session: ${current.phase}…`;
      later(recover, POLL_MS);
      return;
    }
    if (current.state === "snapshot") { route(); return; }
    status.textContent = "";
    open();
  };
  const reread = async () => {
    sink.reset();
    cursor = 0;
    try { // one read from 0 answers the whole history; payloadBase64 holds its exact bytes
      const page = await api("POST", `/sessions/${id}/read`, { offset: 0 });
      sink.write(base64ToBytes(page.payloadBase64));
      cursor = page.nextOffset;
    } catch (e) { status.textContent = e.message; }
    if (!isClosed()) open();
  };
  const open = () => {
    source = openStream(`${API}/sessions/${id}/stream?offset=${cursor}`, (type, data) => {
      if (type === "output") {
        const chunk = JSON.parse(data);
        if (chunk.offset !== cursor) return; // overlap after a reconnect: already shown
        sink.write(base64ToBytes(chunk.payloadBase64));
        cursor = chunk.nextOffset;
      } else if (type === "reset") {
        source.close();
        reread();
      }
    }, () => { if (!isClosed()) recover(); });
  };
  open();
  cleanups.push(() => { if (source) source.close(); clearTimeout(retry); });
}

// The agent's status, polled passively (status never resumes a session); null while it is not active.
function pollStatus(id, cleanups, onStatus) {
  const poll = setInterval(async () => {
    try { onStatus((await api("GET", `/sessions/${id}/status`)).agent); }
    catch (_) { /* the state poll reports errors */ }
  }, STATUS_POLL_MS);
  cleanups.push(() => clearInterval(poll));
}

async function relaunch(id, status) {
  try { await api("POST", `/sessions/${id}/relaunch`, {}); return true; }
  catch (e) { status.textContent = e.message; return false; }
}

// What the terminal does with a link the workload printed (an OSC 8 hyperlink, which xterm.js
// offers on click; plain URLs are not made links at all). The workload chose it, so a link to
// this server itself (any of its loopback names, on its port) is refused: opened with the
// user's session it would act for the workload. Another http(s) link opens only when the user
// says so, in a new tab with no opener and no Referer.
function workloadLinks(status) {
  const loopback = ["localhost", "127.0.0.1", "[::1]"];
  const port = (url) => url.port || (url.protocol === "https:" ? "443" : "80");
  const isThisServer = (url) => url.origin === location.origin ||
    (port(url) === port(location) && loopback.includes(url.hostname) && loopback.includes(location.hostname));
  return {
    allowNonHttpProtocols: false,
    activate(_event, text) {
      let url;
      try { url = new URL(text); } catch (_) { return; }
      if (!["http:", "https:"].includes(url.protocol)) return;
      if (isThisServer(url)) {
        status.textContent = `refused a link the session printed to this server itself: ${url.href}`;
        return;
      }
      if (confirm(`The session printed a link to ${url.href}\n\nOpen it in a new tab?`)) {
        window.open(url.href, "_blank", "noopener,noreferrer");
      }
    },
  };
}

function shellView(id, toolbar, status, cleanups) {
  const frame = h("div", { class: "terminal-frame", "data-test": "terminal" });
  // Once the shell has exited every keystroke is refused: offer a new one in its place.
  const exitNote = h("span", {});
  const relaunchButton = h("button", { class: "primary", "data-test": "relaunch", onclick: async () => {
    relaunchButton.disabled = true;
    if (await relaunch(id, status)) { exited.hidden = true; term.focus(); }
    relaunchButton.disabled = false;
  } }, "Relaunch");
  const exited = h("div", { class: "notice", "data-test": "exited", hidden: true }, exitNote, relaunchButton);
  show(toolbar, exited, frame, status);
  const term = new Terminal({ cursorBlink: true, fontSize: 14, fontFamily: "DejaVu Sans Mono, monospace",
                              scrollback: 5000, theme: { background: "#000000" },
                              linkHandler: workloadLinks(status) });
  term.open(frame);
  window.reployTerminal = term; // for tests and the console

  // Keystrokes in order: one write in flight, the rest batched behind it.
  let pending = [], sending = false;
  const flush = async () => {
    if (sending || !pending.length) return;
    sending = true;
    const data = pending.join("");
    pending = [];
    try {
      await api("POST", `/sessions/${id}/write`, { payload: data });
      status.textContent = "";
    } catch (e) { status.textContent = `write failed: ${e.message}`; }
    sending = false;
    flush();
  };
  term.onData((data) => { pending.push(data); flush(); });

  // Fit the terminal to its frame and tell the PTY.
  let size = "";
  const fit = () => {
    const cell = term._core && term._core._renderService && term._core._renderService.dimensions.css.cell;
    if (!cell || !cell.width || !cell.height) return;
    const columns = Math.max(2, Math.floor((frame.clientWidth - 12) / cell.width));
    const rows = Math.max(2, Math.floor((frame.clientHeight - 12) / cell.height));
    if (`${columns}x${rows}` === size) return;
    size = `${columns}x${rows}`;
    term.resize(columns, rows);
    api("POST", `/sessions/${id}/resize`, { columns, rows }).catch((e) => { status.textContent = e.message; });
  };
  const observer = new ResizeObserver(() => fit());
  observer.observe(frame);
  requestAnimationFrame(fit);
  term.focus();
  cleanups.push(() => { observer.disconnect(); term.dispose(); delete window.reployTerminal; });
  pollStatus(id, cleanups, (agent) => {
    if (!agent || relaunchButton.disabled) return;
    exited.hidden = agent.running;
    if (!agent.running) {
      const code = agent.exitCode;
      exitNote.textContent = `The shell has exited${code === null ? "" : code >= 0 ? ` (status ${code})` : ` (signal ${-code})`}. `;
    }
  });
  return { write: (bytes) => term.write(bytes), reset: () => term.reset() };
}

function agentView(id, toolbar, status, cleanups) {
  const transcript = h("pre", { class: "transcript", "data-test": "transcript" });
  const prompt = h("textarea", { placeholder: "Ask the agent… (Ctrl+Enter sends)", "data-test": "prompt" });
  const queue = h("span", { class: "muted", "data-test": "queue" }, "");
  const send = h("button", { class: "primary", "data-test": "send", onclick: () => submit() }, "Send");
  const interrupt = h("button", { class: "danger", "data-test": "interrupt", onclick: async () => {
    try { const r = await api("POST", `/sessions/${id}/interrupt`, {}); status.textContent = r.cancelled ? "interrupted" : "nothing to interrupt"; }
    catch (e) { status.textContent = e.message; }
  } }, "Interrupt");
  // Relaunch ends the current run and forgets the conversation, so it asks first.
  const confirmRelaunch = h("div", { class: "notice", "data-test": "relaunch-confirmation", hidden: true },
    "Relaunch ends the current run and forgets the conversation: the next prompt starts a new one. ",
    h("button", { class: "danger confirm", "data-test": "confirm-relaunch", onclick: async () => {
      confirmRelaunch.hidden = true;
      if (await relaunch(id, status)) status.textContent = "relaunched: the next prompt starts a new conversation";
    } }, "Relaunch and forget"),
    h("button", { "data-test": "cancel-relaunch", onclick: () => { confirmRelaunch.hidden = true; } }, "Cancel"));
  const relaunchButton = h("button", { "data-test": "relaunch", onclick: () => { confirmRelaunch.hidden = false; } }, "Relaunch");
  show(toolbar, h("div", { class: "agent" }, transcript,
       h("div", { class: "prompt" }, prompt, h("div", { class: "buttons" }, send, interrupt, relaunchButton)),
       confirmRelaunch, queue), status);

  async function submit() {
    const text = prompt.value;
    if (!text.trim()) return;
    send.disabled = true;
    try {
      const r = await api("POST", `/sessions/${id}/message`, { text });
      prompt.value = "";
      status.textContent = r.delivery === "queued" ? `queued (${r.queueDepth} waiting)` : "sent";
    } catch (e) { status.textContent = e.message; }
    send.disabled = false;
  }
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); submit(); }
  });

  pollStatus(id, cleanups, (agent) => {
    queue.textContent = agent ? `turn: ${agent.turnState} · queued: ${agent.queueDepth}` : "";
  });

  let decoder = new TextDecoder();
  return {
    write: (bytes) => {
      const atBottom = transcript.scrollTop + transcript.clientHeight >= transcript.scrollHeight - 4;
      transcript.append(decoder.decode(bytes, { stream: true }));
      if (atBottom) transcript.scrollTop = transcript.scrollHeight;
    },
    reset: () => { decoder = new TextDecoder(); transcript.textContent = ""; },
  };
}

// ---- restore --------------------------------------------------------------------------------

function restoreScreen(session) {
  const error = h("div", { class: "error" });
  const button = h("button", { class: "primary", "data-test": "restore", onclick: async () => {
    button.disabled = true;
    button.textContent = "Restoring…";
    try { await api("POST", `/sessions/${session.id}/switch`, {}); route(); }
    catch (e) { error.textContent = e.message; button.disabled = false; button.textContent = "Restore"; }
  } }, "Restore");
  const checkpoint = session.checkpoint || {};
  const size = checkpoint.sizeBytes ? `${Math.ceil(checkpoint.sizeBytes / 1024)} KiB archive` : "archive";
  const taken = when(checkpoint.createdAt || session.stateSince);
  show(h("div", { class: "toolbar" }, h("h1", {}, session.name), badge(session.state)),
       h("div", { class: "restore", "data-test": "restore-screen" },
         h("p", {}, `This ${session.workloadType} session was snapshotted ${ago(Date.now() / 1000 - taken)} (${size}). ` +
                    "Its container was removed; its output and workspace are kept."),
         h("p", { class: "muted" }, session.workloadType === "shell"
           ? "Restoring starts a fresh shell in a new container; the earlier output stays above it."
           : "Restoring starts a new container; the conversation continues where it stopped."),
         failureNote(session), h("div", {}, button), error));
}

route();
