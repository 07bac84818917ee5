"""The gateway's access log leaves out successful probes (scrapes of /metrics, /health checks) unless
it logs at debug; every other request keeps its line."""

import logging

import pytest

from services.gateway.access_log import ProbeFilter

ACCESS_FORMAT = '%s - "%s %s HTTP/%s" %d'  # uvicorn's


def line(method: str, path: str, status: int) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, ACCESS_FORMAT,
                             ("127.0.0.1:5000", method, path, "1.1", status), None)


@pytest.fixture
def access_level():
    logger = logging.getLogger("uvicorn.access")
    before = logger.level
    yield logger.setLevel
    logger.setLevel(before)


@pytest.mark.parametrize("method,path,status,kept", [
    ("GET", "/metrics", 200, False), ("GET", "/health", 200, False), ("GET", "/health?full=1", 200, False),
    ("HEAD", "/metrics", 200, False), ("HEAD", "/health", 503, True),
    ("GET", "/health", 503, True), ("POST", "/v1/completions", 200, True), ("GET", "/v1/models", 200, True),
    ("POST", "/metrics", 405, True), ("GET", "/metrics/x", 404, True)])
def test_probes_are_left_out(access_level, method, path, status, kept):
    access_level(logging.INFO)
    assert ProbeFilter().filter(line(method, path, status)) is kept


def test_at_debug_every_line_is_kept(access_level):
    access_level(logging.DEBUG)
    assert ProbeFilter().filter(line("GET", "/metrics", 200))


def test_other_records_pass():
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "plain", None, None)
    assert ProbeFilter().filter(record)
