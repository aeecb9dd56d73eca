"""serve's model proxy (ModelProxy) in a process of its own, as in serve, for a test that
measures the proxy's memory apart from its own (the fake upstream and the clients):

  python3 tests/model_proxy_process.py DIR UPSTREAM_URL CA_FILE

reads the credential from its stdin's first line, listens on DIR/agent/model.sock (session
`s1`), prints `ready`, then answers each further line with its peak resident size so far in
bytes (ru_maxrss), until its stdin closes.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reploy_serve  # noqa: E402


def main() -> None:
    directory, url, ca = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    credential = sys.stdin.readline().strip()
    agent_dir = directory / "agent"
    agent_dir.mkdir(mode=0o700, exist_ok=True)
    proxy = reploy_serve.ModelProxy(reploy_serve.parse_model_upstream(url, ca, "x-api-key"), credential)
    proxy.listen("s1", agent_dir)
    print("ready", flush=True)
    for _ in sys.stdin:
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)  # KiB on Linux
    proxy.close()


if __name__ == "__main__":
    main()
