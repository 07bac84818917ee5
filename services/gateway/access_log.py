"""uvicorn's access lines, less the probes: a successful ``GET /metrics`` (Prometheus, every few
seconds) or ``GET /health`` (Kubernetes, the launcher, a load balancer), or the same as ``HEAD`` (an
uptime check), is not logged unless the gateway logs at debug; every other request is one line, as
uvicorn writes it."""

import logging

PROBE_PATHS = ("/metrics", "/health")


class ProbeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:  # uvicorn's: client, method, path, version, status
            return True
        _, method, path, _, status = args
        probe = method in ("GET", "HEAD") and str(path).split("?")[0] in PROBE_PATHS and int(status) < 400
        return not probe or logging.getLogger("uvicorn.access").isEnabledFor(logging.DEBUG)


def quiet_probes() -> None:
    """Installs the filter on uvicorn's access logger."""
    logging.getLogger("uvicorn.access").addFilter(ProbeFilter())
