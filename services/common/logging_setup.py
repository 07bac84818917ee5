"""One logging setup for every service: ``--log-level`` and ``--log-format text|json``, a timestamp
on every line, and the request's ids on every line logged while a request is served.

    add_logging_args(parser)
    args = parser.parse_args()
    setup_logging(args.log_level, args.log_format, service="strata-router", instance="router-0")

Text lines read ``2026-01-02 03:04:05,678 INFO services.router.server: message`` and, inside a
request, end with `` [request_id=... trace_id=... span_id=...]``. JSON lines are one object each, for
a log shipper (``kubectl logs``, journald, Loki): ``timestamp`` (ISO 8601, UTC), ``level``,
``logger``, ``message``, ``service``, ``instance``, and inside a request ``request_id``,
``trace_id``, ``span_id`` (W3C hex, as Jaeger shows them), ``exception`` with a traceback. The ids
come from the current OpenTelemetry span and `services.common.request_id`; a trace id is there when
the request is traced (an OTLP endpoint is set, or the client sent a ``traceparent``).
"""

import argparse
import json
import logging
import sys
from datetime import datetime, timezone

from opentelemetry import trace

from services.common import request_id

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(request_context)s"


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                        help="least severe level logged (default: %(default)s)")
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="text: one readable line per record; json: one JSON object per line, for log "
                             "shippers (default: %(default)s)")


def setup_logging(level: str = "info", log_format: str = "text", service: str = "",
                  instance: str = "") -> None:
    """Replaces the root logger's handlers with one to stderr in ``log_format`` at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestContextFilter())
    handler.setFormatter(JsonFormatter(service, instance) if log_format == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)


class RequestContextFilter(logging.Filter):
    """Adds ``request_id``, ``trace_id`` and ``span_id`` (None outside a request) to each record, and
    ``request_context``, their text form."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        record.request_id = request_id.current()
        record.trace_id = format(context.trace_id, "032x") if context.is_valid else None
        record.span_id = format(context.span_id, "016x") if context.is_valid else None
        ids = [f"{name}={getattr(record, name)}" for name in ("request_id", "trace_id", "span_id")
               if getattr(record, name)]
        record.request_context = f" [{' '.join(ids)}]" if ids else ""
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str = "", instance: str = "") -> None:
        super().__init__()
        self._process = {key: value for key, value in (("service", service), ("instance", instance)) if value}

    def format(self, record: logging.LogRecord) -> str:
        entry = {"timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage(), **self._process}
        for name in ("request_id", "trace_id", "span_id"):
            if getattr(record, name, None):
                entry[name] = getattr(record, name)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)
