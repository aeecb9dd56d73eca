"""The integration examples under examples/, run end to end as a user runs them: copy the example
folder elsewhere, run its prepare.sh against this checkout, stage and build both blueprints with
`python3 reploy.py`, run the session, and read the result and the controller's artifacts."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, run_reploy, stage_and_build
from pngdecode import Image, decode_png

pytestmark = pytest.mark.docker


def prepare(name: str, tmp_path: Path) -> Path:
    """The example, copied out of the checkout, prepared, staged and built."""
    copy = tmp_path / name
    shutil.copytree(ROOT / "examples" / name, copy,
                    ignore=shutil.ignore_patterns("staging", "out", "__pycache__"))
    proc = subprocess.run(["sh", str(copy / "prepare.sh"), str(ROOT)], capture_output=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr.decode()
    for role in ("controller", "workload"):
        stage_and_build(copy / f"{role}.blueprint.yaml", copy / "staging" / role)
    return copy


def run(copy: Path, *options: str) -> tuple[dict[str, Any], Path]:
    """`controlled-session run` with the README's options; the host result must be ok."""
    out = copy / "out"
    proc = run_reploy("controlled-session", "run",
                      "--controller-dir", str(copy / "staging" / "controller"),
                      "--workload-dir", str(copy / "staging" / "workload"),
                      "--output-dir", str(out), *options)
    stderr = proc.stderr.decode(errors="replace")[-4000:]
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 and result["ok"] is True, f"{result}\n{stderr}"
    # The controller kept the terminated result it acknowledged: it is the host's.
    terminated = json.loads((out / "terminated.json").read_text())
    assert terminated["result"] == result["session_result"]
    return result, out


#: The recording example's page (examples/recording/workload/project/page.html), as rendered.
PAGE_TITLE = "Reploy recording example"
PAGE_URL = "http://workload:8080/"
BANNER_RGB = (0x00, 0x5F, 0x87)
MARKER_RGB = (0xFF, 0xD7, 0x5F)
BACKGROUND_RGB = (0xF4, 0xF1, 0xEA)


def box_colours(image: Image, box: dict[str, float]) -> Counter[tuple[int, int, int]]:
    """The colours of the whole pixels inside a DOM bounding box (CSS px = device px here)."""
    x0, y0 = math.ceil(box["x"]), math.ceil(box["y"])
    x1 = min(image.width, math.floor(box["x"] + box["width"]))
    y1 = min(image.height, math.floor(box["y"] + box["height"]))
    assert x1 - x0 >= 10 and y1 - y0 >= 10, box
    return Counter(image.pixel(x, y) for y in range(y0, y1) for x in range(x0, x1))


def check_screenshot(out: Path, marker: str) -> None:
    """page.png is Chromium's rendering of the workload's page with this session's marker, and
    the browser addressed nothing but the granted endpoint."""
    page = json.loads((out / "page.json").read_text())
    assert (page["url"], page["final_url"], page["http_status"]) == (PAGE_URL, PAGE_URL, 200)
    assert page["title"] == PAGE_TITLE
    assert page["marker_text"] == marker and page["marker_visible"] is True
    assert page["body_text"].startswith("Served from the recorded shell")
    assert f"Marker: {marker}" in page["body_text"]
    assert page["requests"] and page["requests"][0] == PAGE_URL
    assert all(url.startswith(PAGE_URL) for url in page["requests"]), page["requests"]
    assert page["blocked_requests"] == []
    # Playwright drove Chromium over pipes: no process in the controller listened on TCP.
    assert page["tcp_listeners"] == {"held": [], "processes_unreadable": 0}
    assert page["playwright_core_version"] == "1.48.2"

    data = (out / "page.png").read_bytes()
    image = decode_png(data)
    assert (image.width, image.height) == (page["viewport"]["width"],
                                           page["viewport"]["height"]) == (1024, 640)
    colours = Counter(image.pixels)
    assert len(colours) >= 32  # anti-aliased text: far from blank
    assert colours.most_common(1)[0][1] < 0.9 * len(image.pixels)  # not one uniform colour
    assert colours[BACKGROUND_RGB] > 0.3 * len(image.pixels)
    # The banner's box is the banner's colour, bar its white heading.
    banner = box_colours(image, page["boxes"]["banner"])
    assert banner[BANNER_RGB] > 0.7 * sum(banner.values())
    assert banner[(255, 255, 255)] > 0.02 * sum(banner.values())
    # The marker is drawn where the DOM says: its yellow box holds dark glyph pixels.
    marker_box = box_colours(image, page["boxes"]["marker"])
    assert marker_box[MARKER_RGB] > 0.4 * sum(marker_box.values())
    glyphs = sum(n for rgb, n in marker_box.items() if sum(rgb) < 200)
    assert glyphs > 0.05 * sum(marker_box.values())


def test_recording_writes_a_cast_and_a_screenshot_of_the_served_page(docker_engine: Any,
                                                                     tmp_path: Path) -> None:
    copy = prepare("recording", tmp_path)
    check_recording(*run(copy, "--endpoint", "web", "--", "record"))


def check_recording(result: dict[str, Any], out: Path) -> None:
    """A recording run's cast, report and screenshot: every command typed, echoed and
    answered in order, the last by the prompt."""
    assert result["session_result"]["cause"] == "workload-exit"
    lines = (out / "session.cast").read_text().splitlines()
    header = json.loads(lines[0])
    assert header["version"] == 2 and (header["width"], header["height"]) == (120, 40)
    assert isinstance(header["timestamp"], int)
    events = [json.loads(line) for line in lines[1:]]
    assert events and all(len(e) == 3 and e[1] == "o" and isinstance(e[2], str) for e in events)
    times = [e[0] for e in events]
    assert all(isinstance(t, (int, float)) and t >= 0 for t in times) and times == sorted(times)
    screen = "".join(e[2] for e in events)
    report = json.loads((out / "report.json").read_text())
    assert report["error"] is None and report["recorder_exit"] == 0
    browser = report["browser"]
    marker = browser["marker"]
    assert re.fullmatch(r"rec-[0-9a-f]{12}", marker)
    commands = [c["command"] for c in report["commands"]]
    assert commands == ["cat README", "ls -l", "./countdown.sh 3", "echo $((6 * 7))", "uname -s",
                        f"./serve.sh {marker}", "killall httpd"]
    assert all(c["exit_status"] == 0 for c in report["commands"])
    position = 0
    for typed, printed in zip(commands, ["A tiny project", "countdown.sh", "liftoff", "42",
                                         "Linux", "serving /tmp/site on port 8080",
                                         "[0] rec$ "]):
        position = screen.index(typed + "\r\n", position)  # typed, echoed by the workload
        position = screen.index(printed, position)  # then its output, in order
    assert report["cast_facts"] == {"version": 2, "width": 120, "height": 40,
                                    "events": len(events), "duration_s": times[-1],
                                    "bytes": (out / "session.cast").stat().st_size}
    # The browser step ran between serve.sh and killall, both answered by the same live shell.
    assert browser["url"] == PAGE_URL and browser["exit_status"] == 0
    assert browser["png_facts"] == {"width": 1024, "height": 640,
                                    "bytes": (out / "page.png").stat().st_size}
    check_screenshot(out, marker)


def test_recording_without_the_endpoint_grant_says_so(docker_engine: Any, tmp_path: Path) -> None:
    copy = prepare("recording", tmp_path)
    out = copy / "out"
    proc = run_reploy("controlled-session", "run",
                      "--controller-dir", str(copy / "staging" / "controller"),
                      "--workload-dir", str(copy / "staging" / "workload"),
                      "--output-dir", str(out), "--", "record")
    result = json.loads(proc.stdout)
    # The controller ends the session itself and exits 1; no browser ever started.
    assert result["session_result"]["cause"] == "controller-terminate"
    assert result["controller_status"] == {"kind": "exited", "code": 1}
    report = json.loads((out / "report.json").read_text())
    assert report["error"] == "the session grants no 'web' endpoint (run it with --endpoint web)"
    assert report["commands"] == [] and report["browser"] is None
    assert not (out / "page.png").exists() and not (out / "page.json").exists()


def test_sandboxed_agent_is_driven_through_typed_requests(docker_engine: Any,
                                                          tmp_path: Path) -> None:
    copy = prepare("sandboxed-agent", tmp_path)
    assert (copy / "workload" / "agent.py").read_bytes() == (ROOT / "agent.py").read_bytes()
    result, out = run(copy, "--endpoint", "agent", "--", "drive-agent")
    report = json.loads((out / "report.json").read_text())
    assert report["error"] is None
    assert report["endpoint"] == {"id": "agent", "scheme": "tcp", "host": "workload", "port": 7000}
    assert report["status_at_start"]["turn_state"] == "idle"
    assert report["first_message"]["delivery"] == "dispatched"
    # Busy: the long run is in progress, so the next message waits in the agent's queue.
    assert report["busy_message"]["delivery"] == "dispatched"
    assert report["queued_message"] == {"type": "message", "delivery": "queued", "queue_depth": 1}
    busy = report["status_while_busy"]
    assert (busy["turn_state"], busy["queue_depth"]) == ("in_progress", 1)
    assert busy["pid"] is not None
    # The interrupt's receipt says a run was in flight; the queued message ran afterwards.
    assert report["interrupt"] == {"type": "interrupt", "cancelled": True}
    end = report["status_at_end"]
    assert (end["turn_state"], end["queue_depth"], end["pid"]) == ("idle", 0, None)
    output = (out / "agent-output.txt").read_text()
    assert output == ("Hello from inside the sandbox\ndone\nworking\n[reploy: interrupted]\n"
                      "queued while the agent was busy\n")
    assert report["notes_md"] == "the agent was here"  # the agent edited its project copy
    exchanges = [json.loads(line) for line in (out / "transcript.jsonl").read_text().splitlines()]
    assert {e["request"]["method"] for e in exchanges} == {"status", "message", "interrupt", "read"}
    assert all(e["response"]["id"] == e["request"]["id"] and "result" in e["response"]
               for e in exchanges)


def test_security_inspection_finds_the_planted_weaknesses(docker_engine: Any,
                                                          tmp_path: Path) -> None:
    copy = prepare("security-inspection", tmp_path)
    result, out = run(copy, "--endpoint", "web", "--", "inspect")
    report = json.loads((out / "findings.json").read_text())
    assert report["target"] == "http://workload:8080"
    by_id: dict[str, list[dict[str, Any]]] = {}
    for finding in report["findings"]:
        by_id.setdefault(finding["id"], []).append(finding)
    assert set(by_id) == {"missing-security-header", "server-version-disclosed",
                          "directory-listing", "reflected-parameter"}
    assert len(by_id["missing-security-header"]) == 4
    assert [f["url"] for f in by_id["directory-listing"]] == ["http://workload:8080/files/"]
    reflected, = by_id["reflected-parameter"]
    assert reflected["severity"] == "high" and "/search?q=" in reflected["url"]
    # Evidence from hostile responses is escaped: printable ASCII only, and short.
    for finding in report["findings"]:
        assert all(" " <= c <= "~" for c in finding["evidence"]), finding
        assert len(finding["evidence"]) <= 163
    assert all("error" not in probe for probe in report["probes"])
    # The workload could reach neither the controller's output mount nor the findings file.
    isolation = json.loads((out / "isolation.json").read_text())
    assert isolation == {"output_mount_visible": False, "findings_files_found": [],
                         "reploy_environment_variables": 0, "workload_isolated": True}
