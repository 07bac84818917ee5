"""Whether a service answers yet: the checks `Stack` waits on and supervises with."""

import socket
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # services.common.tls imports grpc, which must not load before the children fork
    from services.common.tls import TlsFiles


def tcp_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def grpc_serving(addr: str, tls: "TlsFiles | None" = None) -> bool:
    from services.common.health_probe import serving  # imports grpc: only once the children are spawned

    return serving(addr, timeout_s=1.0, tls=tls)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
