"""One streaming Messages API request read whole: ms to its first text delta, MiB/s of the
whole answer. Stdlib only and one file: bench_model_proxy.py uses it in its own process and
runs it (`python3 -c` with this file's text) inside a claude-code session's container, where it
reaches the model proxy as the CLI does, through the agent's relay on 127.0.0.1.

  python3 model_reader.py HOST PORT CA_FILE|- PLACEHOLDER   (prints [ms, MiB/s, bytes] as JSON)
"""

from __future__ import annotations

import http.client
import json
import ssl
import sys
import time

FIRST_DELTA = b"content_block_delta"
READ_BYTES = 64 * 1024
TIMEOUT_S = 60.0
MIB = 1024 * 1024


def read_answer(connection: http.client.HTTPConnection, placeholder: str) -> tuple[float, float, int]:
    """(ms to the first delta, MiB/s of the whole answer, its bytes); the connection is closed."""
    started = time.perf_counter()
    connection.request("POST", "/v1/messages?beta=true", body=b'{"stream": true}', headers={
        "x-api-key": placeholder, "anthropic-version": "2023-06-01",
        "content-type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the answer's status is {response.status}")
    first, total, seen = None, 0, b""
    while chunk := response.read1(READ_BYTES):
        total += len(chunk)
        if first is None:
            seen = seen[-len(FIRST_DELTA):] + chunk
            if FIRST_DELTA in seen:
                first = time.perf_counter()
    ended = time.perf_counter()
    connection.close()
    if first is None:
        raise RuntimeError("the answer holds no text delta")
    return (first - started) * 1000, total / MIB / (ended - started), total


def main(argv: list[str]) -> int:
    host, port, ca_file, placeholder = argv
    if ca_file == "-":
        connection = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    else:
        connection = http.client.HTTPSConnection(
            host, int(port), context=ssl.create_default_context(cafile=ca_file), timeout=TIMEOUT_S)
    print(json.dumps(read_answer(connection, placeholder)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
