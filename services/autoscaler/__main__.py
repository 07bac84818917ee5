"""``python -m services.autoscaler --nats-url nats://H:P --provider local --model DIR`` (also
``strata autoscaler ...``): scales the engine replicas on their queue length and KV usage.

Providers: ``local`` runs the engines as processes on this machine (what `strata up --autoscale`
uses); ``kubernetes`` scales the engine Deployment through the Kubernetes API (in-cluster
credentials). The decision is the same for both (`decision.py`)."""

import argparse
import shlex
from pathlib import Path

import uvloop

from services.autoscaler.decision import ScalingPolicy
from services.common.logging_setup import add_logging_args, setup_logging
from services.common.telemetry import setup_tracing
from services.common.tls import add_tls_args, tls_from_args

PROVIDERS = ("local", "kubernetes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata autoscaler", description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", choices=PROVIDERS, default="local",
                        help="who runs the replicas (default: %(default)s)")
    parser.add_argument("--nats-url", required=True, help="the NATS server the engines publish their load reports on")
    parser.add_argument("--host", default="127.0.0.1", help="address of its gRPC health service (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50070, help="gRPC health port, 0 for any (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (default: none)")
    policy = parser.add_argument_group("policy (HPA semantics; signals: waiting requests and KV usage, never CPU)")
    defaults = ScalingPolicy()
    policy.add_argument("--min-replicas", type=int, default=defaults.min_replicas,
                        help="fewest engine replicas kept running (default: %(default)s)")
    policy.add_argument("--max-replicas", type=int, default=defaults.max_replicas,
                        help="most engine replicas run at once (default: %(default)s)")
    policy.add_argument("--target-waiting", type=float, default=defaults.target_waiting,
                        help="waiting requests per ready replica before the fleet grows (default: %(default)s)")
    policy.add_argument("--target-kv-usage", type=float, default=defaults.target_kv_usage,
                        help="mean KV-cache usage before the fleet grows (default: %(default)s)")
    policy.add_argument("--scale-down-utilization", type=float, default=defaults.scale_down_utilization,
                        help="shrink only when the load fits on fewer replicas at this fraction of their batch "
                             "slots and KV (default: %(default)s)")
    policy.add_argument("--tolerance", type=float, default=defaults.tolerance,
                        help="no scale-up while a signal is within this fraction of its target (default: %(default)s)")
    policy.add_argument("--scale-up-stabilization", type=float, default=defaults.scale_up_stabilization_s,
                        help="seconds: scale up to the lowest count asked for within this window (default: "
                             "%(default)s)")
    policy.add_argument("--scale-down-stabilization", type=float, default=defaults.scale_down_stabilization_s,
                        help="seconds: scale down to the highest count asked for within this window "
                             "(default: %(default)s)")
    policy.add_argument("--cooldown", type=float, default=defaults.cooldown_s,
                        help="seconds after a scale action before the next (default: %(default)s)")
    policy.add_argument("--warmup-timeout", type=float, default=defaults.warmup_timeout_s,
                        help="seconds a starting replica holds decisions back before it is given up on "
                             "(default: %(default)s)")
    policy.add_argument("--interval", type=float, default=2.0, help="seconds between decisions (default: %(default)s)")
    policy.add_argument("--load-max-age", type=float, default=5.0,
                        help="seconds after which a replica's last load report no longer counts (default: %(default)s)")
    k8s = parser.add_argument_group("kubernetes provider")
    k8s.add_argument("--namespace", help="of the engine Deployment (default: the autoscaler pod's own)")
    k8s.add_argument("--deployment", default="strata-engine", help="the engine Deployment (default: %(default)s)")
    local = parser.add_argument_group("local provider")
    local.add_argument("--model", help="checkpoint directory the engines serve (required with --provider local)")
    local.add_argument("--engine-args", default="",
                       help="more engine flags, one quoted string, e.g. \"--max-num-seqs 32\" (default: none)")
    local.add_argument("--engine-host", default="127.0.0.1",
                       help="address the engines listen on (default: %(default)s)")
    local.add_argument("--drain-timeout", type=float, default=60.0,
                       help="seconds a drained engine may take to finish its requests (its --shutdown-timeout) "
                            "(default: %(default)s)")
    local.add_argument("--log-dir", type=Path,
                       help="write each engine's log to DIR/<replica>.log (default: prefixed to this process's output)")
    add_tls_args(parser)  # its health service; the local provider's engines get the same files
    add_logging_args(parser)  # the local provider's engines log the same way, unless --engine-args say otherwise
    return parser


def policy_from_args(args: argparse.Namespace) -> ScalingPolicy:
    return ScalingPolicy(min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                         target_waiting=args.target_waiting, target_kv_usage=args.target_kv_usage,
                         scale_down_utilization=args.scale_down_utilization, tolerance=args.tolerance,
                         scale_up_stabilization_s=args.scale_up_stabilization,
                         scale_down_stabilization_s=args.scale_down_stabilization, cooldown_s=args.cooldown,
                         warmup_timeout_s=args.warmup_timeout)


def make_provider(args: argparse.Namespace, parser: argparse.ArgumentParser, tls):
    if args.provider == "kubernetes":
        from services.autoscaler.kubernetes_provider import KubernetesProvider

        return KubernetesProvider(namespace=args.namespace, deployment=args.deployment)
    from services.autoscaler.local_provider import LocalProcessProvider

    if not args.model:
        parser.error("--provider local needs --model (the checkpoint the engines serve)")
    engine_args = ["--model", args.model, "--nats-url", args.nats_url, "--shutdown-timeout", str(args.drain_timeout),
                   "--log-level", args.log_level, "--log-format", args.log_format, *shlex.split(args.engine_args)]
    return LocalProcessProvider(engine_args, args.max_replicas, host=args.engine_host, log_dir=args.log_dir,
                                echo_logs=args.log_dir is None, drain_timeout_s=args.drain_timeout, tls=tls)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        policy = policy_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    if args.interval <= 0 or args.load_max_age <= 0:
        parser.error("--interval and --load-max-age must be > 0")
    setup_logging(args.log_level, args.log_format, service="strata-autoscaler")
    setup_tracing("strata-autoscaler")
    from services.autoscaler.load import FleetLoad
    from services.autoscaler.metrics import AutoscalerMetrics
    from services.autoscaler.service import Controller, serve

    metrics = AutoscalerMetrics()
    if args.metrics_port is not None:
        metrics.start_http_server(args.host, args.metrics_port)
    tls = tls_from_args(args, parser)
    provider = make_provider(args, parser, tls)
    controller = Controller(policy, provider, FleetLoad(args.load_max_age), metrics)
    uvloop.run(serve(controller, args.nats_url, args.host, args.port, args.interval, tls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
