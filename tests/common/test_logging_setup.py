"""services.common.logging_setup: --log-level and --log-format on every service, a timestamp on every
line, and a request's ids on the lines logged while it is served."""

import argparse
import json
import re
import subprocess
import sys

import pytest

from services.common.logging_setup import add_logging_args

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) demo: ")


def run_logging(log_format: str) -> list[str]:
    """Lines a child process logs: one outside a request, one inside, one with a traceback."""
    code = f"""
import logging
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from services.common import request_id
from services.common.logging_setup import setup_logging
setup_logging("info", {log_format!r}, service="strata-demo", instance="demo-0")
trace.set_tracer_provider(TracerProvider())
log = logging.getLogger("demo")
log.debug("not shown")
log.info("starting")
with trace.get_tracer("t").start_as_current_span("request") as span, request_id.bound("req-1"):
    log.warning("inside %s", "the request")
    print("ids", format(span.get_span_context().trace_id, "032x"), format(span.get_span_context().span_id, "016x"))
try:
    1 / 0
except ZeroDivisionError:
    log.exception("it broke")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()[1:] + result.stderr.splitlines()


def test_text_lines_have_a_timestamp_and_inside_a_request_its_ids():
    trace_id, span_id, *lines = run_logging("text")
    assert TEXT_LINE.match(lines[0]) and lines[0].endswith("demo: starting")
    assert TEXT_LINE.match(lines[1])
    assert lines[1].endswith(f"inside the request [request_id=req-1 trace_id={trace_id} span_id={span_id}]")
    assert "Traceback" in lines[3] and "not shown" not in "\n".join(lines)


def test_json_lines_parse_and_carry_the_requests_ids():
    trace_id, span_id, *lines = run_logging("json")
    records = [json.loads(line) for line in lines]
    outside, inside, broken = records
    assert outside["message"] == "starting" and outside["level"] == "INFO" and outside["logger"] == "demo"
    assert outside["service"] == "strata-demo" and outside["instance"] == "demo-0"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", outside["timestamp"])
    assert "trace_id" not in outside and "request_id" not in outside
    assert inside["message"] == "inside the request" and inside["request_id"] == "req-1"
    assert inside["trace_id"] == trace_id and inside["span_id"] == span_id
    assert broken["level"] == "ERROR" and "ZeroDivisionError" in broken["exception"]


def test_the_flags():
    parser = argparse.ArgumentParser()
    add_logging_args(parser)
    args = parser.parse_args([])
    assert (args.log_level, args.log_format) == ("info", "text")
    args = parser.parse_args(["--log-level", "DEBUG", "--log-format", "json"])
    assert (args.log_level, args.log_format) == ("debug", "json")
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-format", "xml"])


@pytest.mark.slow  # runs each service's --help in a new interpreter
@pytest.mark.parametrize("module", ["services.engine", "services.router", "services.gateway", "services.tokenizer",
                                    "services.autoscaler", "services.launcher"])
def test_every_service_takes_the_flags(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--log-level" in result.stdout and "--log-format" in result.stdout
