"""Free TCP ports for services that a launcher (`strata up`, the autoscaler's local provider) starts
next and tells which port to bind."""

import random
import socket

_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PORT = 20_000  # picked ports stay at or above this, below the kernel's ephemeral range
_handed_out: set[int] = set()  # by this process, so two services of one stack never get the same


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a service started next. The service binds it a moment
    later, so it comes from below the kernel's ephemeral range where there is one (Linux: 32768 and
    up by default): the kernel gives ports from that range to outgoing connections, and one that took
    the port in between made the service's bind fail (seen in CI: a tokenizer's metrics port)."""
    low = _ephemeral_range_start()
    if low is not None and low - _LOWEST_PORT >= 1000:
        rng = random.SystemRandom()
        for _ in range(100):
            port = rng.randrange(_LOWEST_PORT, low)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    with socket.socket() as sock:  # no range to stay out of (or all tries taken): the kernel's pick
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_range_start() -> int | None:
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
