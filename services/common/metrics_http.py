"""A service's Prometheus `/metrics` on a port of its own, always in the text format 0.0.4.

prometheus-client's own server answers a scraper that offers OpenMetrics (Prometheus does) in
OpenMetrics, and its newer releases then escape every character outside ``[a-zA-Z0-9_]`` in metric
names: `strata:generation_tokens_total` would reach Prometheus as `strata_generation_tokens_total`,
and no query or dashboard written against the documented names (vLLM's style, colon included)
would find it. The classic text format keeps the names as written, and every Prometheus reads it.

HEAD gets GET's status and headers without the body, as the gateway's `/metrics` (a FastAPI route)
answers it: load balancers and uptime checks probe with HEAD, which http.server refuses (501) for a
handler without ``do_HEAD``.

A scraper that hung up before its answer was written (its scrape timeout passed while the process was
paused or busy) is not an error of this process: nothing is logged for it, where http.server prints a
traceback.
"""

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest


def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> ThreadingHTTPServer:
    """Serves ``registry`` at ``/metrics`` (and ``/``) from a daemon thread; returns the server."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._answer(with_body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(with_body=False)

        def _answer(self, with_body: bool) -> None:
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)  # (http.server leaves the body out for HEAD)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def log_message(self, *args) -> None:  # a scrape every few seconds is not news
            pass

    server = _QuietServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipe, ConnectionReset: it left
            super().handle_error(request, client_address)
