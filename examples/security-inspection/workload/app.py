"""A deliberately weak test application for the security-inspection example. Never deploy it.

    python3 /srv/app.py PORT

Its planted weaknesses, for the scanner in the controller to find:
  * /search?q=... reflects q into HTML without escaping (reflected cross-site scripting);
  * /files/ answers with a directory listing;
  * no response carries security headers, and the Server header discloses versions.
"""

import sys
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

SITE = "/srv/site"


class WeakHandler(SimpleHTTPRequestHandler):
    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path != "/search":
            super().do_GET()  # static files, with directory listings
            return
        query = parse_qs(url.query).get("q", [""])[0]
        body = f"<!doctype html><html><body><h1>Results for {query}</h1><p>none</p></body></html>"
        data = body.encode()  # the planted flaw: `query` is not escaped
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> int:
    port = int(sys.argv[1])
    server = ThreadingHTTPServer(("0.0.0.0", port), partial(WeakHandler, directory=SITE))
    print(f"weak-app: listening on port {port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
