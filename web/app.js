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
// A create's labels and time to live, as the API checks them (reploy_serve's _LABEL_KEY,
// _LABEL_VALUE, MAX_LABELS, MAX_TTL_S; a test holds them equal): the form says what is wrong
// before asking, and the API's own answer is shown for what only the server knows (its bounds).
const LABEL_KEY_PATTERN = "[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?";
const LABEL_VALUE_PATTERN = "[A-Za-z0-9._:@/+=-]{0,128}";
const MAX_LABELS = 32;
const MAX_TTL_SECONDS = 30 * 24 * 3600;

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

// The server's clock less this one's, in seconds (to the second), from the last answer's Date
// header: the countdowns run on the server's clock.
let clockSkew = 0;

function serverNow() { return Date.now() / 1000 + clockSkew; }

// One request with the credential: a 401 shows the login screen, an error status throws
// ApiError with the server's message.
async function request(url, init) {
  const response = await fetch(url, authorized(init));
  const served = Date.parse(response.headers.get("Date"));
  if (!Number.isNaN(served)) clockSkew = served / 1000 - Date.now() / 1000;
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

// ---- a session's facts: id, labels, time to live, CPU and disk -------------------------------
// Labels are whatever the creator chose: they reach the page as text nodes only (h), never as
// markup.

function labelChips(labels) {
  const entries = Object.entries(labels || {});
  if (!entries.length) return h("span", { class: "muted", "data-test": "labels" }, "none");
  return h("span", { class: "chips", "data-test": "labels" },
           ...entries.map(([key, value]) => h("span", { class: "chip", "data-label": key }, `${key}=${value}`)));
}

// What is left of a session's time to live (expiresAt), e.g. "expires in 59 min"; "none" without one.
function timeToLive(s) {
  if (!s.expiresAt) return "none";
  const left = Math.floor(when(s.expiresAt) - serverNow());
  if (left <= 0) return "expired: deleting";
  if (left < 60) return `expires in ${left} s`;
  const minutes = Math.floor(left / 60);
  if (minutes < 60) return `expires in ${minutes} min`;
  if (minutes < 48 * 60) return `expires in ${Math.floor(minutes / 60)} h${minutes % 60 ? ` ${minutes % 60} min` : ""}`;
  return `expires in ${Math.floor(minutes / 1440)} d ${Math.floor(minutes % 1440 / 60)} h`;
}

function cpuText(s) { return s.cpus === undefined ? "—" : `${s.cpus} CPU`; }
function diskText(s) { return s.diskMib === undefined ? "—" : `${s.diskMib} MiB`; }

// The facts line of a session's page; update(s) refreshes its time to live.
function sessionFacts(session) {
  const ttl = h("span", { "data-test": "ttl" }, timeToLive(session));
  const fact = (name, ...value) => h("div", { class: "fact" }, h("span", { class: "fact-name" }, name), ...value);
  const node = h("div", { class: "facts", "data-test": "facts" },
    fact("ID", h("code", { class: "session-id", "data-test": "session-id" }, session.id)),
    fact("Labels", labelChips(session.labels)),
    fact("TTL", ttl),
    fact("CPU", h("span", { "data-test": "cpus" }, cpuText(session))),
    fact("Disk", h("span", { "data-test": "disk" }, diskText(session))));
  return { node, update: (s) => { ttl.textContent = timeToLive(s); } };
}

// A Delete button that asks first; once the session is deleted, back to the list.
function deleteControl(id, status) {
  const confirmation = h("div", { class: "notice", "data-test": "delete-confirmation", hidden: true },
    "Delete this session? Its container, disk and output are removed for good. ",
    h("button", { class: "danger confirm", "data-test": "confirm-delete", onclick: async () => {
      confirmation.hidden = true;
      try { await api("DELETE", `/sessions/${id}`); location.hash = "#/"; }
      catch (e) { status.textContent = e.message; }
    } }, "Delete for good"),
    h("button", { "data-test": "cancel-delete", onclick: () => { confirmation.hidden = true; } }, "Cancel"));
  const button = h("button", { class: "danger", "data-test": "delete", onclick: () => { confirmation.hidden = false; } }, "Delete");
  return { button, confirmation };
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
  const columns = ["Name", "Labels", "Workload", "State", "CPU", "Disk", "TTL", "Last access", "Idle countdown", ""];
  let sessions = [], stopped = false;
  const confirming = new Set();

  function countdown(s) {
    const now = serverNow();
    if (s.phase) return `${s.phase}…`;
    if (s.idleBlockedBy && s.idleBlockedBy.length) return `held: ${s.idleBlockedBy.join(", ")}`;
    if (s.state === "active" && s.idleAt) return `idle in ${clock(when(s.idleAt) - now)}`;
    if (s.state === "idle" && s.snapshotAt) return `snapshot in ${clock(when(s.snapshotAt) - now)}`;
    return "—";
  }

  function draw() {
    const now = serverNow();
    if (!sessions.length) {
      body.replaceChildren(h("tr", {}, h("td", { colspan: columns.length, class: "empty" }, "No sessions yet. ", h("a", { href: "#/new" }, "Create one."))));
      return;
    }
    body.replaceChildren(...sessions.map((s) => {
      const del = confirming.has(s.id)
        ? [h("button", { class: "danger confirm", "data-test": "confirm-delete", onclick: () => remove(s.id) }, "Confirm delete"),
           h("button", { onclick: () => { confirming.delete(s.id); draw(); } }, "Cancel")]
        : [h("button", { class: "danger", "data-test": "delete", onclick: () => { confirming.add(s.id); draw(); } }, "Delete")];
      return h("tr", { "data-session": s.id },
        h("td", {}, h("a", { href: `#/s/${s.id}`, "data-test": "open" }, s.name),
          h("div", {}, h("code", { class: "short-id", title: s.id, "data-test": "short-id" }, s.id.slice(0, 8)))),
        h("td", { class: "labels" }, labelChips(s.labels)),
        h("td", {}, s.workloadType + (s.model ? ` · ${s.model}` : ""), h("div", { class: "muted" }, s.deployment)),
        h("td", {}, badge(s.state)),
        h("td", { "data-test": "cpus" }, cpuText(s)),
        h("td", { "data-test": "disk" }, diskText(s)),
        h("td", { class: "muted", "data-test": "ttl" }, timeToLive(s)),
        h("td", { class: "muted" }, ago(now - when(s.lastAccess))),
        h("td", { class: "muted", "data-test": "countdown", title: failureText(s) },
          countdown(s), s.lastFailure ? h("div", { class: "error", "data-test": "last-failure" }, `${s.lastFailure.step} failed`) : null),
        h("td", { class: "actions" }, ...del));
    }));
  }

  async function refresh() {
    try {
      sessions = (await api("GET", "/sessions")).sessions || [];
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
         h("thead", {}, h("tr", {}, ...columns.map((t) => h("th", {}, t)))),
         body));
  refresh();
  const poll = setInterval(refresh, POLL_MS);
  const tick = setInterval(draw, 1000);
  teardown = () => { stopped = true; clearInterval(poll); clearInterval(tick); };
}

// ---- new session ----------------------------------------------------------------------------

// "team=red, task=a" -> { team: "red", task: "a" }: entries split at commas, each at its first
// "=" (a value may hold "="), checked as the API checks them. Throws with what is wrong.
function parseLabels(text) {
  const key = new RegExp(`^(?:${LABEL_KEY_PATTERN})$`), value = new RegExp(`^(?:${LABEL_VALUE_PATTERN})$`);
  const labels = new Map();
  for (const entry of text.split(",").map((e) => e.trim()).filter(Boolean)) {
    const equals = entry.indexOf("=");
    if (equals < 0) throw new Error(`labels: ${JSON.stringify(entry)} is not key=value`);
    const k = entry.slice(0, equals), v = entry.slice(equals + 1);
    if (!key.test(k)) throw new Error(`labels: the key ${JSON.stringify(k)} is not a label key (${LABEL_KEY_PATTERN})`);
    if (!value.test(v)) throw new Error(`labels.${k}: the value ${JSON.stringify(v)} does not match ${LABEL_VALUE_PATTERN}`);
    if (labels.has(k)) throw new Error(`labels: ${k} is given twice`);
    labels.set(k, v);
  }
  if (labels.size > MAX_LABELS) throw new Error(`labels: at most ${MAX_LABELS}`);
  return Object.fromEntries(labels);
}

// A duration as every Reploy command line writes one ("90s", "30m", "1.5h": a number and
// one unit of ms, s, m or h) -> whole seconds. Throws for anything else.
const DURATION_MS = { ms: 1, s: 1000, m: 60000, h: 3600000 };
function parseDuration(text) {
  const parts = /^([0-9]{1,12})(?:\.([0-9]{1,9}))?(ms|s|m|h)$/.exec(text);
  if (!parts) throw new Error(`${JSON.stringify(text)} is not a duration such as 90s, 30m or 1.5h`);
  const ms = (Number(parts[1]) + Number(`0.${parts[2] || 0}`)) * DURATION_MS[parts[3]];
  if (!Number.isInteger(ms / 1000)) throw new Error(`${JSON.stringify(text)} is not a whole number of seconds`);
  return ms / 1000;
}

// The create body from the form's texts: an empty field is left out (the server's default).
function createBody(form) {
  const body = { name: form.name.trim(), workloadType: form.workloadType };
  const model = form.model.trim(), labels = parseLabels(form.labels);
  const ttl = form.ttl.trim(), cpus = form.cpus.trim(), disk = form.disk.trim();
  if (form.workloadType === "claude-code" && model) body.model = model;
  if (form.deployment) body.deployment = form.deployment;
  if (Object.keys(labels).length) body.labels = labels;
  if (ttl) {
    body.ttlSeconds = parseDuration(ttl);
    if (body.ttlSeconds < 1 || body.ttlSeconds > MAX_TTL_SECONDS) throw new Error(`TTL: from 1 second to ${MAX_TTL_SECONDS / 86400} days`);
  }
  if (cpus) {
    if (!/^(\d+(\.\d*)?|\.\d+)$/.test(cpus)) throw new Error(`CPUs: ${JSON.stringify(cpus)} is not a number of cores such as 0.5`);
    body.cpus = Number(cpus);
  }
  if (disk) {
    if (!/^\d+$/.test(disk)) throw new Error(`Disk: ${JSON.stringify(disk)} is not a whole number of MiB`);
    body.diskMib = Number(disk);
  }
  return body;
}

async function newSessionScreen() {
  const error = h("div", { class: "error", "data-test": "error" });
  const name = h("input", { name: "name", required: true, placeholder: "my-session", "data-test": "name" });
  const workload = h("select", { name: "workloadType", "data-test": "workload" },
                     h("option", { value: "shell" }, "shell"), h("option", { value: "claude-code" }, "claude-code"));
  const models = h("datalist", { id: "models" });
  const model = h("input", { name: "model", list: "models", placeholder: "platform default", "data-test": "model" });
  const modelField = h("label", { hidden: true }, "Model", model, models);
  const labels = h("input", { name: "labels", placeholder: "team=red, task=a", "data-test": "labels", autocomplete: "off" });
  const ttl = h("input", { name: "ttl", placeholder: "none", "data-test": "ttl", autocomplete: "off" });
  const cpus = h("input", { name: "cpus", inputmode: "decimal", placeholder: "server default", "data-test": "cpus", autocomplete: "off" });
  const disk = h("input", { name: "disk", inputmode: "numeric", placeholder: "server default", "data-test": "disk", autocomplete: "off" });
  const deployment = h("select", { name: "deployment", "data-test": "deployment" });
  const submit = h("button", { class: "primary", type: "submit", "data-test": "create" }, "Create session");
  workload.addEventListener("change", () => { modelField.hidden = workload.value !== "claude-code"; });

  const form = h("form", { class: "form", onsubmit: async (event) => {
    event.preventDefault();
    error.textContent = "";
    let body;
    try {
      body = createBody({ name: name.value, workloadType: workload.value, model: model.value, labels: labels.value,
                          ttl: ttl.value, cpus: cpus.value, disk: disk.value, deployment: deployment.value });
    } catch (e) { error.textContent = e.message; return; }
    submit.disabled = true;
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
    h("label", {}, "Labels", labels, h("span", { class: "hint" }, "key=value, comma-separated; find sessions by them")),
    h("div", { class: "form-row" },
      h("label", {}, "TTL", ttl, h("span", { class: "hint" }, "90s, 30m, 1.5h")),
      h("label", {}, "CPUs", cpus, h("span", { class: "hint" }, "cores, e.g. 0.5")),
      h("label", {}, "Disk (MiB)", disk, h("span", { class: "hint" }, "e.g. 1024"))),
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
  const remove = deleteControl(id, status);
  const facts = sessionFacts(session);
  const toolbar = h("div", { class: "toolbar" }, h("h1", {}, session.name), state,
                    h("span", { class: "muted" }, `${session.workloadType}${session.model ? " · " + session.model : ""} · ${session.deployment}`),
                    h("span", { class: "spacer" }), snapshot, remove.button);
  const failure = h("div", { class: "error", "data-test": "last-failure" }, failureText(session) || "");
  // The views show the toolbar: the last failure, the facts and the delete confirmation go with it.
  toolbar.append(failure, facts.node, remove.confirmation);

  // The session's state, polled passively: a snapshot taken meanwhile routes to restore.
  const poll = setInterval(async () => {
    try {
      const current = await api("GET", `/sessions/${id}`);
      state.className = `badge ${current.state}`;
      state.textContent = current.state;
      failure.textContent = failureText(current) || "";
      facts.update(current);
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
  const remove = deleteControl(session.id, error);
  show(h("div", { class: "toolbar" }, h("h1", {}, session.name), badge(session.state), h("span", { class: "spacer" }),
         remove.button, sessionFacts(session).node, remove.confirmation),
       h("div", { class: "restore", "data-test": "restore-screen" },
         h("p", {}, `This ${session.workloadType} session was snapshotted ${ago(Date.now() / 1000 - taken)} (${size}). ` +
                    "Its container was removed; its output and workspace are kept."),
         h("p", { class: "muted" }, session.workloadType === "shell"
           ? "Restoring starts a fresh shell in a new container; the earlier output stays above it."
           : "Restoring starts a new container; the conversation continues where it stopped."),
         failureNote(session), h("div", {}, button), error));
}

route();
