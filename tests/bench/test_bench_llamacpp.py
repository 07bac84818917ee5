"""The llama.cpp baseline's pieces that need no build: the tokenizer check behind the GGUF's "gpt-2"
pre-tokenizer, the server's command line, its health wait, and stopping it (with a stand-in server)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.bench.llamacpp import server_command, verify_pre_tokenizer, wait_healthy
from services.default_model.model import ensure_default_model
from services.launcher import find_free_port
from tests.waiting import wait_until


def test_builtin_tokenizer_pre_tokenizes_as_gpt2(tmp_path):
    verify_pre_tokenizer(ensure_default_model())
    spec = json.loads((ensure_default_model() / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="does not pre-tokenize as GPT-2"):
        verify_pre_tokenizer(tmp_path)


def test_server_command_gives_every_slot_its_context(tmp_path):
    command = server_command(tmp_path / "llama-server", tmp_path / "m.gguf", 8081, threads=2, parallel=64,
                             ctx_per_slot=1024)
    flags = dict(zip(command[1::2], command[2::2]))
    assert command[0] == str(tmp_path / "llama-server") and flags["-m"] == str(tmp_path / "m.gguf")
    assert (flags["--host"], flags["--port"], flags["-t"], flags["-tb"]) == ("127.0.0.1", "8081", "2", "2")
    assert (flags["--parallel"], flags["-c"]) == ("64", str(64 * 1024))
    assert "--cont-batching" in command


def test_health_wait_fails_fast_when_the_server_exits():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="exited with 3"):
        wait_healthy(process, port=9, timeout_s=30)


HEALTHY_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_the_server_on_sigterm_and_on_sigint_even_when_started_in_the_background(tmp_path, signum):
    """`strata bench llamacpp serve &` from a script: the shell leaves SIGINT ignored, and a SIGTERM
    used to kill the wrapper alone, leaving llama-server running."""
    port = find_free_port()
    (tmp_path / "server.py").write_text(HEALTHY_SERVER)
    command = [sys.executable, str(tmp_path / "server.py"), str(port)]
    wrapper = f"from services.bench.llamacpp import serve; raise SystemExit(serve({command!r}, {port}))"
    process = subprocess.Popen([sys.executable, "-c", wrapper], stdout=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as `cmd &` does
    try:
        assert "healthy" in process.stdout.readline()
        (server,) = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True,
                                                         text=True).stdout.split()]
        process.send_signal(signum)
        assert process.wait(timeout=30) == 0
        wait_until(lambda: not Path(f"/proc/{server}").exists(), what="the server stopped")  # and reaped
    finally:
        process.kill()
