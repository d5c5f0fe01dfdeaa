"""A real HTTP server on loopback playing every kind of media host the tests need."""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from typing import ClassVar

PNG = b"\x89PNG\r\n\x1a\n" + b"x" * 100  # bytes only the fetcher sees


class UpstreamHandler(http.server.BaseHTTPRequestHandler):
    """/ok.png the image; /to/<url> a redirect; /loop a redirect to itself; /status/<code>;
    /huge a declared 10^12 bytes; /endless a chunked body without end; /bomb a gzip bomb
    (100 MiB of zeros); /drip one byte every `drip_interval` seconds. Every request is recorded."""

    hits: ClassVar[list[str]]
    png: ClassVar[bytes]
    drip_interval: ClassVar[float]

    def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
        pass

    def do_GET(self) -> None:
        self.hits.append(self.path)
        path = self.path
        if path == "/ok.png":
            self._send(200, self.png, {"Content-Type": "image/png"})
        elif path.startswith("/to/"):
            self._send(302, b"", {"Location": path.removeprefix("/to/")})
        elif path == "/loop":
            self._send(302, b"", {"Location": "/loop"})
        elif path.startswith("/status/"):
            self._send(int(path.removeprefix("/status/")), b"status")
        elif path == "/huge":
            self.send_response(200)
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
        elif path == "/endless":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._write_forever(b"10000\r\n" + b"z" * 65536 + b"\r\n", 0.0)
        elif path == "/bomb":
            self._send(200, gzip.compress(b"\0" * (100 << 20), compresslevel=9), {"Content-Encoding": "gzip"})
        elif path == "/drip":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self._write_forever(b"x", self.drip_interval)
        else:
            self._send(404, b"")

    def _write_forever(self, piece: bytes, pause: float) -> None:
        try:
            for _ in range(10_000):
                self.wfile.write(piece)
                self.wfile.flush()
                time.sleep(pause)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve(png: bytes = PNG, drip_interval: float = 0.05) -> tuple[http.server.ThreadingHTTPServer, list[str]]:
    """Start one on a free loopback port; returns it and the list of paths it was asked for."""
    hits: list[str] = []
    handler = type("Handler", (UpstreamHandler,), {"hits": hits, "png": png, "drip_interval": drip_interval})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, hits
