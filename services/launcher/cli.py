"""`strata up`: the whole stack on loopback, tokenizer + engine + gateway, as child processes.

The command line: its flags, the engine and gateway flags it passes through, the banner, and
Ctrl-C/SIGTERM (a first one drains, a second stops at once).
"""

import argparse
import json
import os
import shlex
import signal
import sys
from pathlib import Path

from services.common.logging_setup import LOG_FORMATS, LOG_LEVELS
from services.common.model_source import resolve_model_dir
from services.common.supervisor import CrashLoopError
from services.engine.engine_args import add_engine_passthrough_args
from services.launcher.config import StackConfig
from services.launcher.stack import Stack, StartupError

# EngineConfig fields `strata up` takes as flags of its own and passes to the engines when given (besides
# --enable-prefix-caching); any other engine flag goes through --engine-args
ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks",
                "max_logprobs", "seed", "dtype", "device", "attention_backend", "generation_config",
                "override_generation_config", "quantization", "enforce_eager", "stream_interval",
                "tensor_parallel_size", "kv_cache_dtype")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="strata up", description=__doc__.split("\n\n")[0])
    defaults = StackConfig()
    parser.add_argument("--model", help="Hugging Face checkpoint directory (default: the built-in model)")
    parser.add_argument("--host", default=defaults.host, help="address of the gateway (default: %(default)s)")
    parser.add_argument("--port", type=int, default=defaults.port, help="port of the gateway (default: %(default)s)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the model name clients send, or several (any is accepted; the first is the main one) "
                             "(default: --model, or strata-tiny-v1 for the built-in model)")
    parser.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $STRATA_API_KEY; the gateway gets "
                             "it in its environment, and it is never printed)")
    parser.add_argument("--replicas", type=int, default=defaults.replicas,
                        help="engine replicas; more than one adds a router (and NATS for its prefix-aware "
                             "routing) in front of them (default: %(default)s)")
    engine = parser.add_argument_group("engine (passed through when given; `strata engine --help` lists them all)")
    add_engine_passthrough_args(engine, [*ENGINE_FLAGS, "enable_prefix_caching"])
    engine.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM's command lines: Strata runs no code from a checkpoint (default: off)")
    engine.add_argument("--engine-args", default="",
                        help="more engine flags, one quoted string, e.g. \"--stream-interval 4\" (a single flag: "
                             "--engine-args=--flag) (default: none)")
    gateway = parser.add_argument_group("gateway")
    gateway.add_argument("--enable-auto-tool-choice", action="store_true",
                         help='read tool calls out of the model\'s text (tool_choice "auto"); needs --tool-call-parser')
    gateway.add_argument("--tool-call-parser", help="the model's tool-call format, e.g. hermes (default: none)")
    gateway.add_argument("--reasoning-parser", help="the model's thinking format, e.g. deepseek_r1: chat messages "
                                                    "carry it as reasoning (default: none)")
    gateway.add_argument("--allowed-origins", help="JSON list of the origins whose web pages may call the API "
                                                   "(CORS), as vLLM's flag (default: any)")
    gateway.add_argument("--allowed-methods", help="JSON list of the methods they may use (default: any)")
    gateway.add_argument("--allowed-headers", help="JSON list of the headers they may send (default: any)")
    gateway.add_argument("--allow-credentials", action="store_true",
                         help="let them send cookies and HTTP auth (default: off)")
    gateway.add_argument("--gateway-args", default="",
                         help="more gateway flags, one quoted string, e.g. \"--max-n 4\" (default: none)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests bring their own chat_template (off by default: a template is code the "
                             "tokenizer runs; it renders in a sandbox with time and size limits)")
    parser.add_argument("--chat-template", default=None,
                        help="the chat template to use instead of the checkpoint's (for a checkpoint without one): "
                             "a file, or the template itself (default: the checkpoint's)")
    parser.add_argument("--tokenizer-args", default="",
                        help="more tokenizer flags, one quoted string, e.g. \"--workers 2\" (default: none)")
    scaling = parser.add_argument_group("autoscaling (engines added and drained on queue length and KV usage)")
    scaling.add_argument("--autoscale", action="store_true",
                         help="let the autoscaler run the engines, between --min-replicas and --max-replicas "
                              "(instead of --replicas)")
    scaling.add_argument("--min-replicas", type=int, default=defaults.min_replicas,
                         help="fewest engines the autoscaler keeps running (default: %(default)s)")
    scaling.add_argument("--max-replicas", type=int, default=defaults.max_replicas,
                         help="most engines it runs at once; each one's threads are the cores divided by this "
                              "number (default: %(default)s)")
    scaling.add_argument("--autoscaler-args", default="",
                         help="more autoscaler flags, one quoted string, e.g. \"--target-waiting 4 --cooldown 10\" "
                              "(default: none)")
    parser.add_argument("--router-args", default="",
                        help="router flags (with --replicas > 1 or --autoscale), one quoted string, e.g. "
                             "\"--policy round-robin\" (default: none)")
    tls = parser.add_argument_group("TLS on every gRPC hop (services.common.tls)")
    tls.add_argument("--tls-cert", type=Path, help="certificate (PEM) every service serves and presents")
    tls.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    tls.add_argument("--tls-ca", type=Path, help="CA (PEM) that signed it: services verify each other (mutual TLS)")
    parser.add_argument("--log-dir", type=Path, help="write each service's log to DIR/<service>.log "
                        "instead of prefixing it to this terminal")
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS,
                        help="every service's --log-level (default: theirs, info)")
    parser.add_argument("--log-format", choices=LOG_FORMATS,
                        help="every service's --log-format: text, or json (one object per line, with trace and "
                             "request ids) (default: text)")
    parser.add_argument("--startup-timeout", type=float, default=defaults.startup_timeout_s,
                        help="seconds the services may take to become healthy, the built-in model's first build, "
                             "a large checkpoint's load and the engine's first graph compilation included (a "
                             "service that fails is named at once) (default: %(default)s)")
    parser.add_argument("--grace", type=float, default=defaults.grace_s,
                        help="seconds the stack may take to stop after Ctrl-C/SIGTERM: running streams finish "
                             "first (the drain), then SIGKILL; a second Ctrl-C stops at once (default: %(default)s)")
    return parser.parse_args(argv)


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in ENGINE_FLAGS:
        value = getattr(args, name)
        if value is True:  # a switch (--enforce-eager)
            flags.append(f"--{name.replace('_', '-')}")
        elif value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if args.enable_prefix_caching is not None:
        flags.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    if args.trust_remote_code:
        flags.append("--trust-remote-code")
    return flags + shlex.split(args.engine_args)


def tokenizer_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--trust-request-chat-template"] if args.trust_request_chat_template else []
    if args.chat_template is not None:
        flags += ["--chat-template", args.chat_template]
    return flags + shlex.split(args.tokenizer_args)


def gateway_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []
    if args.tool_call_parser is not None:
        flags += ["--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser is not None:
        flags += ["--reasoning-parser", args.reasoning_parser]
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", getattr(args, name)]
    if args.allow_credentials:
        flags.append("--allow-credentials")
    return flags + shlex.split(args.gateway_args)


def curl_example(stack: Stack, api_key: str | None) -> str:
    body = json.dumps({"model": stack.model_name, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "Hello!"}]})
    auth = " -H \"Authorization: Bearer $STRATA_API_KEY\"" if api_key else ""  # the key itself is not echoed
    return (f"curl {stack.base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replicas < 1:
        raise SystemExit("strata up: --replicas must be >= 1")
    if args.autoscale and not 1 <= args.min_replicas <= args.max_replicas:
        raise SystemExit("strata up: --autoscale needs 1 <= --min-replicas <= --max-replicas")
    model_dir = args.model
    if args.model is not None:
        try:
            model_dir = resolve_model_dir(args.model)  # a Hub id: its snapshot, found or fetched once here
        except ValueError as error:
            raise SystemExit(f"strata up: {error}") from None
    names = args.served_model_name or ([args.model] if model_dir != args.model else [None])
    config = StackConfig(model=model_dir, host=args.host, port=args.port,
                         served_model_name=names[0], served_model_aliases=names[1:], api_key=args.api_key,
                         engine_args=engine_flags(args), gateway_args=gateway_flags(args),
                         router_args=shlex.split(args.router_args),
                         tokenizer_args=tokenizer_flags(args),
                         log_dir=args.log_dir, echo_logs=args.log_dir is None, replicas=args.replicas,
                         autoscale=args.autoscale, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                         autoscaler_args=shlex.split(args.autoscaler_args),
                         startup_timeout_s=args.startup_timeout, grace_s=args.grace,
                         log_level=args.log_level, log_format=args.log_format)
    if args.tls_cert or args.tls_key or args.tls_ca:
        from services.common.tls import TlsFiles  # imports grpc: after GRPC_ENABLE_FORK_SUPPORT is set

        try:
            config.tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)
        except ValueError as error:
            raise SystemExit(f"strata up: {error}")
    stack = Stack(config)
    _stop_on_signals(stack)
    logs = f" (logs in {args.log_dir})" if args.log_dir else ""
    print(f"strata up: starting the services{logs} ...", flush=True)
    try:
        stack.start()
        autoscaling = f"; autoscaling {args.min_replicas}..{args.max_replicas} engines" if args.autoscale else ""
        print(f"\nstrata up: serving `{stack.model_name}` at {stack.base_url}/v1\n"
              f"  {curl_example(stack, args.api_key)}\n"
              f"  (tokenizer at {stack.tokenizer_addr}, {'engine' if stack.engine_is_direct else 'router'} at "
              f"{stack.engine_addr}{autoscaling}; Ctrl-C stops)\n"
              f"  Prometheus /metrics: {', '.join(f'{n} {u}' for n, u in stack.metrics_urls.items())}\n",
              flush=True)
        stack.wait()
    except KeyboardInterrupt:
        return 0
    except (StartupError, CrashLoopError) as error:
        print(f"strata up: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("strata up: stopping: running streams finish first (Ctrl-C again to stop at once) ...",
              file=sys.stderr, flush=True)
        stack.stop()


def _stop_on_signals(stack: "Stack") -> None:
    """Ctrl-C and SIGTERM both unwind main() into Stack.stop(), which drains; a second one stops
    everything at once."""
    def on_second_signal(*_) -> None:
        print("strata up: stopping now (SIGKILL)", file=sys.stderr, flush=True)
        stack.kill()

    def on_signal(*_) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, on_second_signal)
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
