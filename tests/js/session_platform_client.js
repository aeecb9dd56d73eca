// A small client of seed 002's control-plane API, written from the compatibility reference alone
// (../shared/compat/session-platform-api.md), not from Reploy's code or its web UI. It talks as
// session-platform's SPA does: JSON in and out, `Content-Type: application/json` on every fetch,
// GET and DELETE included; it reads the stream with fetch so that it can send `Last-Event-ID`
// and a bearer token (Reploy's one condition: the token, which the proxy added).
//
// runSessionPlatformClient(token) runs one journey in a page of the server's origin: create
// without a type, write a command, read from 0 checking that the payload's UTF-8 length is the
// cursor's advance, stream with Last-Event-ID, switch, snapshot, delete. It resolves to
// { ok, steps } or { ok: false, error, steps }: every check it made, in order.
"use strict";

async function runSessionPlatformClient(token) {
  const API = "/api/v1";
  const STATES = ["active", "idle", "snapshot"];
  const WORKLOAD_TYPES = ["shell", "claude-code"];
  const DATE_TIME = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$/;
  const steps = [];
  const utf8 = new TextEncoder();

  function check(condition, what) {
    if (!condition) throw new Error(`failed: ${what}`);
    steps.push(what);
  }

  async function fetchApi(method, path, body, extraHeaders = {}) {
    const init = { method, cache: "no-store",
                   headers: { "Content-Type": "application/json", Authorization: `Bearer ${token}`, ...extraHeaders } };
    if (body !== undefined) init.body = JSON.stringify(body);
    return fetch(API + path, init);
  }

  // One call answering `want`: its JSON document, or null for a 204 (which has no body).
  async function call(method, path, body, want) {
    const response = await fetchApi(method, path, body);
    const text = await response.text();
    if (response.status !== want) throw new Error(`${method} ${path}: ${response.status} ${text.slice(0, 300)}`);
    if (want === 204) { check(text === "", `${method} ${path}: 204 without a body`); return null; }
    check((response.headers.get("Content-Type") || "").split(";")[0] === "application/json",
          `${method} ${path}: JSON`);
    const document = JSON.parse(text);
    if (want >= 400) check(typeof document.error === "string" && document.error !== "", `${method} ${path}: an Error`);
    return document;
  }

  function noNull(value, where) {
    check(value !== null, `${where} is not null`);
    if (typeof value === "object") for (const [key, item] of Object.entries(value)) noNull(item, `${where}.${key}`);
  }

  // A Session: the six required fields, the enums, and the model/pod/checkpoint rules.
  function checkSession(session) {
    noNull(session, "session");
    for (const name of ["id", "name", "state", "workloadType", "createdAt", "lastAccess"]) {
      check(name in session, `session.${name} is present`);
    }
    check(STATES.includes(session.state), `state ${session.state} is one of ${STATES}`);
    check(WORKLOAD_TYPES.includes(session.workloadType), `workloadType ${session.workloadType}`);
    check(DATE_TIME.test(session.createdAt) && DATE_TIME.test(session.lastAccess), "times are date-times");
    check((session.workloadType === "claude-code") === ("model" in session), "a model only for claude-code");
    if (session.state === "snapshot") {
      check(!("pod" in session), "a snapshot has no pod");
      const checkpoint = session.checkpoint;
      check(checkpoint && typeof checkpoint.ref === "string" && Number.isInteger(checkpoint.sizeBytes)
            && DATE_TIME.test(checkpoint.createdAt), "a snapshot has its checkpoint");
    } else {
      check(typeof session.pod === "string" && session.pod !== "", `an ${session.state} session has its pod`);
      check(!("checkpoint" in session), "no checkpoint outside snapshot");
    }
    return session;
  }

  // read: {session, path, payload, nextOffset}; the payload is text whose UTF-8 byte length is
  // exactly the cursor's advance.
  async function read(id, offset) {
    const result = await call("POST", `/sessions/${id}/read`, { offset }, 200);
    checkSession(result.session);
    check(typeof result.path === "string" && typeof result.payload === "string"
          && Number.isInteger(result.nextOffset), "a ReadResult");
    if (result.nextOffset > offset) {
      check(utf8.encode(result.payload).length === result.nextOffset - offset,
            "the payload's UTF-8 length is the cursor's advance");
    } else {
      check(result.payload === "", "at the end the payload is empty");
    }
    return result;
  }

  async function until(probe, what, timeoutMs = 30000) {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const value = await probe();
      if (value) return value;
      if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
  }

  function base64Bytes(text) {
    const raw = atob(text);
    return Uint8Array.from(raw, (c) => c.charCodeAt(0));
  }

  // Follows the stream (fetch, so it can send Last-Event-ID and the token) until `done(state)`;
  // every frame is checked: `: connected` first, then output events whose id is their
  // nextOffset and whose decoded bytes number nextOffset - offset, from the cursor on.
  async function stream(id, query, lastEventId, done) {
    const controller = new AbortController();
    const response = await fetch(`${API}/sessions/${id}/stream${query}`, {
      signal: controller.signal, cache: "no-store",
      headers: { Authorization: `Bearer ${token}`, "Last-Event-ID": String(lastEventId) } });
    check(response.status === 200, "the stream opens");
    check(response.headers.get("Content-Type").split(";")[0] === "text/event-stream", "text/event-stream");
    check(response.headers.get("Cache-Control") === "no-cache, no-transform", "the stream is not cached");
    check(response.headers.get("X-Accel-Buffering") === "no", "the stream is not buffered");
    const state = { cursor: lastEventId, bytes: [], frames: 0, first: null };
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let text = "";
    try {
      while (!done(state)) {
        const { value, done: ended } = await reader.read();
        check(!ended, "the stream stays open");
        text += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = text.indexOf("\n\n")) >= 0) {
          const frame = text.slice(0, cut).split("\n");
          text = text.slice(cut + 2);
          if (state.frames++ === 0) check(frame.length === 1 && frame[0] === ": connected", "the first frame is : connected");
          if (frame.every((line) => line.startsWith(":"))) continue;
          const fields = Object.fromEntries(frame.map((line) => [line.slice(0, line.indexOf(":")), line.slice(line.indexOf(":") + 2)]));
          check(fields.event === "output", "an output event");
          const data = JSON.parse(fields.data);
          const payload = base64Bytes(data.payloadBase64);
          check(data.offset === state.cursor, "each output starts at the cursor");
          check(payload.length === data.nextOffset - data.offset, "its bytes are nextOffset - offset");
          check(fields.id === String(data.nextOffset), "its id is its nextOffset");
          if (state.first === null) state.first = data.offset;
          state.bytes.push(...payload);
          state.cursor = data.nextOffset;
        }
      }
    } finally {
      controller.abort();
    }
    return state;
  }

  try {
    // Create without a type: a shell.
    const created = checkSession(await call("POST", "/sessions", { name: "  js client  " }, 201));
    check(created.workloadType === "shell" && created.state === "active" && created.name === "js client",
          "created: an active shell, its name trimmed");
    const id = created.id;
    await until(async () => (await read(id, 0)).payload.includes("$ "), "the prompt");

    // Write a command whose output holds a code point and a byte that is not UTF-8.
    const written = await call("POST", `/sessions/${id}/write`, { payload: "printf 'js-\\303\\251-\\377-%s\\n' $((6*7))\r" }, 200);
    checkSession(written.session);
    check(written.path === "active", "write: served by the active session");

    // Read from 0: the whole history, every read keeping the length rule.
    const history = await until(async () => { const r = await read(id, 0); return r.payload.includes("-42\r\n") && r; }, "the output");
    check(history.payload.includes("js-é-"), "the code point arrives whole");
    check((await read(id, history.nextOffset)).payload === "", "nothing past the end");

    // Stream with Last-Event-ID (it wins over ?offset=0): from byte 5 to the end of the history.
    const streamed = await stream(id, "?offset=0", 5, (state) => state.cursor >= history.nextOffset);
    check(streamed.first === 5, "Last-Event-ID wins over ?offset=");
    const expected = [...utf8.encode("js-"), 0xc3, 0xa9, 0x2d, 0xff, ...utf8.encode("-42")];
    const seen = streamed.bytes.join(",");
    check(seen.includes(expected.join(",")), "the stream carries the exact bytes");

    // switch an active session: nothing changes, lastAccess included.
    const before = checkSession(await call("GET", `/sessions/${id}`, undefined, 200));
    const switched = checkSession(await call("POST", `/sessions/${id}/switch`, {}, 200));
    check(switched.state === "active" && switched.lastAccess === before.lastAccess, "switch leaves an active session as it is");

    // snapshot: no pod, a checkpoint; its stream is 422; a read restores, the history intact.
    const snapshot = checkSession(await call("POST", `/sessions/${id}/snapshot`, {}, 200));
    check(snapshot.state === "snapshot", "snapshotted");
    await call("GET", `/sessions/${id}/stream?offset=0`, undefined, 422);
    const restored = await read(id, 0);
    check(restored.path === "snapshot->restore->read" && restored.payload.startsWith(history.payload),
          "a read restores the snapshot and the history survives");

    // delete: 204, then 404.
    await call("DELETE", `/sessions/${id}`, undefined, 204);
    await call("GET", `/sessions/${id}`, undefined, 404);
    return { ok: true, steps };
  } catch (error) {
    return { ok: false, error: String(error && error.stack || error), steps };
  }
}
