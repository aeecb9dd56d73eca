"""An independent client of seed 002's API, written in JavaScript from the compatibility
reference alone (tests/js/session_platform_client.js), run in headless Chromium against a real
`reploy serve`: create without a type, write a command, read from 0 checking the byte-length
rule, stream with Last-Event-ID, switch, snapshot, delete. It authenticates with the bearer
token and runs in a page of the server's own origin (the UI's openapi.json, which holds no
script), as the issue's proxy made the peer's SPA do.

Skips without chromium only when REPLOY_REQUIRE_DOCKER is unset; in CI it must run.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from cdp import Browser
from serve_harness import (  # noqa: F401  (fixtures)
    ROOT, ServeProcess, browser, managed_workload, serve_factory, session_containers,
)

pytestmark = pytest.mark.docker
CLIENT = ROOT / "tests" / "js" / "session_platform_client.js"


def test_an_independent_javascript_client_in_chromium(serve_factory: Callable[..., ServeProcess],
                                                      docker_engine: Any, browser: Browser) -> None:
    server = serve_factory()
    browser.navigate(server.ready["url"] + "/openapi.json")
    browser.wait_for(f"location.href === {json.dumps(server.ready['url'] + '/openapi.json')} && "
                     "document.readyState === 'complete'", "a page of the server's origin")
    browser.evaluate(CLIENT.read_text())
    browser.evaluate(f"runSessionPlatformClient({json.dumps(server.ready['token'])})"
                     ".then((result) => { window.clientResult = result; })")
    result = browser.wait_for("window.clientResult", "the client's journey", timeout_s=180)
    assert result["ok"], result
    for step in ("created: an active shell, its name trimmed",
                 "the payload's UTF-8 length is the cursor's advance",
                 "Last-Event-ID wins over ?offset=", "the stream carries the exact bytes",
                 "switch leaves an active session as it is",
                 "a read restores the snapshot and the history survives"):
        assert step in result["steps"], step
    sid = next(step.split()[1].split("/")[2].rstrip(":") for step in result["steps"] if step.startswith("DELETE "))
    assert f"DELETE /sessions/{sid}: 204 without a body" in result["steps"]
    assert f"GET /sessions/{sid}/stream?offset=0: an Error" in result["steps"]  # the 422
    assert server.api.call("GET", "/sessions") == {"sessions": []}
    assert not session_containers(docker_engine, server.state_dir)
