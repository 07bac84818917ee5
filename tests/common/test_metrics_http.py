"""The /metrics server: the text format with the documented names, HEAD as GET without the body, and no
traceback for a scraper that hung up before its answer was written (Prometheus' scrape timeout against a
paused process)."""

import socket
import struct
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.registry import Collector

from services.common.metrics_http import start_metrics_server
from services.launcher import find_free_port


class SlowCollector(Collector):
    """Holds the scrape until ``release`` is set."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def collect(self):
        self.entered.set()
        self.release.wait(10)
        return []


@pytest.fixture
def things_url():
    """The base URL of a metrics server whose registry holds one counter, strata:things at 1."""
    registry = CollectorRegistry()
    Counter("strata:things", "Things.", registry=registry).inc()
    port = find_free_port()
    server = start_metrics_server("127.0.0.1", port, registry)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()


def test_names_are_served_as_written(things_url):
    request = urllib.request.Request(f"{things_url}/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert "strata:things_total 1.0" in response.read().decode()


def test_head_answers_as_get_without_the_body(things_url):
    with urllib.request.urlopen(f"{things_url}/metrics", timeout=5) as response:
        length = int(response.headers["Content-Length"])
    with urllib.request.urlopen(urllib.request.Request(f"{things_url}/metrics", method="HEAD"), timeout=5) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert int(response.headers["Content-Length"]) == length
    with socket.create_connection(("127.0.0.1", int(things_url.rsplit(":", 1)[1])), timeout=5) as raw:
        raw.sendall(b"HEAD /metrics HTTP/1.0\r\n\r\n")  # (urllib would not read a body after HEAD)
        answer = b"".join(iter(lambda: raw.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"\r\n\r\n")  # the headers, no body
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(urllib.request.Request(f"{things_url}/nothing", method="HEAD"), timeout=5)
    assert missing.value.code == 404


def test_a_scraper_that_left_is_no_error(capfd):
    registry = CollectorRegistry()
    slow = SlowCollector()
    registry.register(slow)
    port = find_free_port()
    server = start_metrics_server("127.0.0.1", port, registry)
    try:
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert slow.entered.wait(5)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # a reset: the answer's write fails
        slow.release.set()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert response.status == 200  # and the server goes on
    finally:
        server.shutdown()
    assert "Traceback" not in capfd.readouterr().err
