"""The inspector: dynamic inspection of a target application that runs in the workload.

Runs in the controller container as `inspect` (python3 /opt/controller/inspect_target.py); the
session must grant the workload endpoint `web` (--endpoint web) and give an --output-dir.

1. It starts the target in the workload's shell (`python3 /srv/app.py 8080 &`).
2. It probes the target only through the granted endpoint with a small stdlib scanner: security
   headers, directory listings, a reflected query parameter.
3. It writes findings.json, then checks from the workload's own shell that the workload can see
   neither the controller's output directory nor the findings (isolation.json), ends the session
   and keeps the full terminated result in terminated.json.

Every response and every terminal byte is hostile input: reads are bounded, nothing is followed
(no redirects) or evaluated, and evidence is truncated and escaped before it is reported.
"""

import http.client
import json
import os
import secrets
import sys
import urllib.parse
from dataclasses import asdict, dataclass
from typing import Any, Optional

from reploy_driver import SessionDriver, SessionFailed

ENDPOINT_ID = "web"
MAX_BODY_BYTES = 64 * 1024  #: a response body is read up to this, the rest is never read
REQUEST_TIMEOUT_S = 5.0
MAX_EVIDENCE_CHARS = 160  #: evidence kept in a finding, after escaping
LISTING_PATHS = ("/", "/files/", "/static/", "/backup/")
#: Header -> what its absence allows. A response is judged on the headers it actually carries.
SECURITY_HEADERS = {
    "content-security-policy": "no Content-Security-Policy: injected script runs",
    "x-content-type-options": "no X-Content-Type-Options: nosniff: content types can be sniffed",
    "x-frame-options": "no X-Frame-Options: the page can be framed (clickjacking)",
    "referrer-policy": "no Referrer-Policy: full URLs leak to other sites",
}
LISTING_MARKERS = (b"<title>Directory listing for", b"<title>Index of")


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-cased names; a repeated header keeps its last value
    body: bytes  # at most MAX_BODY_BYTES
    truncated: bool


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str  # "high", "medium", "low" or "info"
    url: str
    title: str
    evidence: str  # escaped, truncated: safe to print and to embed in a report


def escape_evidence(data: bytes | str) -> str:
    """Untrusted bytes as short, printable ASCII: anything else becomes a backslash escape, so
    no terminal escape sequence or control character survives into a report."""
    text = data.decode("utf-8", "backslashreplace") if isinstance(data, bytes) else data
    escaped = "".join(c if " " <= c <= "~" and c != "\\"
                      else c.encode("unicode_escape").decode("ascii") for c in text)
    return escaped if len(escaped) <= MAX_EVIDENCE_CHARS else escaped[:MAX_EVIDENCE_CHARS] + "..."


class Target:
    """The target's HTTP endpoint. One connection per request, nothing followed, bounded reads."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.probes: list[dict[str, Any]] = []

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    def get(self, path: str) -> Optional[Response]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            connection.request("GET", path, headers={"User-Agent": "reploy-example-inspector"})
            raw = connection.getresponse()  # http.client bounds header lines and their count
            body = raw.read(MAX_BODY_BYTES + 1)
            response = Response(raw.status, {k.lower(): v for k, v in raw.getheaders()},
                                body[:MAX_BODY_BYTES], len(body) > MAX_BODY_BYTES)
        except (OSError, http.client.HTTPException) as e:
            self.probes.append({"path": escape_evidence(path), "error": escape_evidence(str(e))})
            return None
        finally:
            connection.close()
        self.probes.append({"path": escape_evidence(path), "status": response.status,
                            "body_bytes": len(response.body), "truncated": response.truncated})
        return response


def check_headers(target: Target) -> list[Finding]:
    response = target.get("/")
    if response is None:
        return []
    findings = [Finding("missing-security-header", "low", target.url("/"), problem,
                        escape_evidence(f"headers present: {', '.join(sorted(response.headers))}"))
                for header, problem in SECURITY_HEADERS.items() if header not in response.headers]
    server = response.headers.get("server", "")
    if any(ch.isdigit() for ch in server):
        findings.append(Finding("server-version-disclosed", "info", target.url("/"),
                                "the Server header discloses software versions",
                                escape_evidence(f"Server: {server}")))
    return findings


def check_directory_listings(target: Target) -> list[Finding]:
    findings = []
    for path in LISTING_PATHS:
        response = target.get(path)
        if response is None or response.status != 200:
            continue
        marker = next((m for m in LISTING_MARKERS if m in response.body), None)
        if marker is not None:
            start = response.body.index(marker)
            findings.append(Finding("directory-listing", "medium", target.url(path),
                                    "the server lists a directory's files",
                                    escape_evidence(response.body[start:start + 120])))
    return findings


def check_reflection(target: Target, parameter: str = "q", path: str = "/search") -> list[Finding]:
    """A random canary with HTML metacharacters: reflected as sent means unescaped."""
    canary = f"<rpl{secrets.token_hex(4)}>\"'"
    query = f"{path}?{urllib.parse.urlencode({parameter: canary})}"
    response = target.get(query)
    if response is None:
        return []
    if canary.encode() in response.body:
        start = response.body.index(canary.encode())
        return [Finding("reflected-parameter", "high", target.url(query),
                        f"the {parameter!r} parameter is reflected into HTML unescaped "
                        "(reflected cross-site scripting)",
                        escape_evidence(response.body[max(start - 40, 0):start + 60]))]
    return []


def start_target(session: SessionDriver) -> None:
    # Request logs go to a file in the workload; the start line is only a hint (the phrase is not
    # in the typed text), the first probe is the proof.
    session.type("python3 /srv/app.py 8080 2>/tmp/app.log &\n")
    session.expect(rb"weak-app: listening on port 8080")


def check_isolation(session: SessionDriver) -> dict[str, Any]:
    """From the workload's own shell: the controller's output must be out of reach. Each search
    also looks for something that must exist, so a broken search cannot pass as isolation."""
    facts: dict[str, Any] = {}
    home_status, _ = session.run("ls -ld /mnt/reploy-home")
    output_status, _ = session.run("ls -ld /mnt/reploy-output")
    facts["output_mount_visible"] = output_status == 0 if home_status == 0 else None
    _, output = session.run(
        "printf '@@%s@@\\n' found; find / \\( -path /proc -o -path /sys \\) -prune -o "
        "\\( -name findings.json -o -name app.py \\) -print 2>/dev/null")
    found = output.partition(b"@@found@@\r\n")[2].split()
    searched = b"/srv/app.py" in found
    facts["findings_files_found"] = ([escape_evidence(path) for path in found
                                      if path.endswith(b"findings.json")] if searched else None)
    # HOME is counted too, as the control: the count minus one is the REPLOY_ variables.
    _, output = session.run("printf '@@%s@@\\n' env; env | grep -c -e '^REPLOY_' -e '^HOME='")
    counted = output.partition(b"@@env@@\r\n")[2].split()
    with_home = int(counted[0]) if counted and counted[0].isdigit() else 0
    facts["reploy_environment_variables"] = with_home - 1 if with_home >= 1 else None
    facts["workload_isolated"] = (facts["output_mount_visible"] is False
                                  and facts["findings_files_found"] == []
                                  and facts["reploy_environment_variables"] == 0)
    return facts


def write_json(path: str, document: Any) -> None:
    with open(path, "w") as f:
        json.dump(document, f, indent=2)
        f.write("\n")


def main() -> int:
    output_dir = os.environ.get("REPLOY_OUTPUT_DIR")
    if not output_dir:
        print("inspect: run the session with --output-dir", file=sys.stderr)
        return 2
    error = None
    with SessionDriver(attach="pipe") as session:
        try:
            opened = session.start()
            endpoint = session.granted_endpoint(opened, ENDPOINT_ID)
            start_target(session)
            target = Target(endpoint["host"], endpoint["port"])
            findings = check_headers(target) + check_directory_listings(target) \
                + check_reflection(target)
            write_json(os.path.join(output_dir, "findings.json"), {
                "target": target.url(""), "findings": [asdict(f) for f in findings],
                "probes": target.probes})
            if all("error" in probe for probe in target.probes):
                raise SessionFailed(f"the target never answered at {target.url('/')}")
            for finding in findings:
                print(f"inspect: [{finding.severity}] {finding.id}: {finding.title} "
                      f"({escape_evidence(finding.url)})", file=sys.stderr)
            write_json(os.path.join(output_dir, "isolation.json"), check_isolation(session))
            session.run("kill %1; wait")
            session.type("exit 0\n")
        except SessionFailed as e:
            error = str(e)
            print(f"inspect: {escape_evidence(error)}", file=sys.stderr)
            if session.close_if_never_ready():
                return 1  # nothing to end: the session never started
            session.send("terminate")
        try:
            outcome = session.finish()
        except SessionFailed as e:
            print(f"inspect: the session did not end cleanly: {e}", file=sys.stderr)
            return 1
    # The whole result, as the host saw it, beside the findings: a cleanup or observation
    # failure stays visible next to the report it may affect.
    write_json(os.path.join(output_dir, "terminated.json"), outcome.terminated)
    return 0 if outcome.client_exit == 0 and error is None else 1


if __name__ == "__main__":
    sys.exit(main())
