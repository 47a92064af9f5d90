"""Stand-in workers for the fleet's failure tests, served from the test process."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StatusServer:
    """Answers every completion with `status` (an OpenAI error body), `/health` with 200 and
    `/v1/abort` with 200; records the time of each completion request."""

    def __init__(self, status: int):
        self.status = status
        self.hits: list[float] = []
        self.aborts = 0
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, code: int, body: bytes):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if code == 429:
                    self.send_header("Retry-After", "1")
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, b"{}")
                else:
                    self._send(404, b"{}")

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/abort":    # the fleet aborts a failed request where it went
                    srv.aborts += 1
                    return self._send(200, b"{}")
                srv.hits.append(time.monotonic())
                self._send(srv.status, json.dumps({"error": {
                    "message": f"stand-in answers {srv.status}", "type": "server_error",
                    "param": None, "code": srv.status}}).encode())

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
