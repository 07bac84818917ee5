"""`strata up`: the whole stack on loopback, tokenizer + engine + gateway, as child processes.

    strata up [--model DIR] [--port 8000] [--max-num-seqs 8] [--engine-args "--block-size 32"]
    strata up --replicas 2      # two engines behind a router, their KV events on a NATS server
    strata up --autoscale --min-replicas 1 --max-replicas 3   # engines added and drained on load

Builds the default model when no --model is given, picks free ports for the internal services,
waits until each one is healthy (gRPC health for the tokenizer and engine, HTTP /health for the
gateway), prints the base URL and a curl example, and prefixes each child's log lines
(``[engine] ...``; not JSON lines, which name their service), or writes them to files under --log-dir.
``--log-level`` and ``--log-format text|json`` reach every service (the autoscaler's engines too);
a service's own flags (``--engine-args "--log-level debug"``) win.

Once the stack serves, its services are supervised (`services.common.supervisor`): one that dies
(a crash, an OOM kill, `kill -9`) is started again after a backoff, and the stack keeps serving
meanwhile: the router sends a dead engine's traffic to the others and an engine that is back gets
traffic once its health says SERVING. `strata up` exits only on Ctrl-C/SIGTERM, or when a service
keeps crashing before it is healthy (named, with the tail of its log). A service that dies during
the first start fails the start at once: nothing served yet, so its configuration is at fault.
Ctrl-C or SIGTERM stops the children: SIGTERM first, SIGKILL after a grace period. Children also get
SIGTERM if the launcher dies (Linux parent-death signal), so none are left behind. NATS stops last,
once the engines, the router and the autoscaler have closed their connections to it.

``Stack`` is the same machinery as a library (the end-to-end tests start the stack with it). One
concept per module: `config` (StackConfig), `stack` (Stack: the services as supervised child
processes), `probes` (health checks; free ports come from `services.common.ports`), `cli` (the `strata up` command).
"""

from services.common.ports import find_free_port
from services.launcher.cli import curl_example, engine_flags, gateway_flags, main, parse_args, tokenizer_flags
from services.launcher.config import StackConfig
from services.launcher.stack import Stack, StartupError, nats_server_binary

__all__ = ["Stack", "StackConfig", "StartupError", "curl_example", "engine_flags", "find_free_port", "gateway_flags",
           "main", "nats_server_binary", "parse_args", "tokenizer_flags"]
