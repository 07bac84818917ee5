"""`python -m services.engine [--model DIR] [--port P] ...` (also `strata engine`)."""

import argparse
import logging

from services.common.logging_setup import add_logging_args, setup_logging
from services.common.telemetry import setup_tracing
from services.common.tls import add_tls_args, tls_from_args
from services.engine.engine_args import add_engine_args, config_from_args, with_local_model
from services.engine.threads import use_openmp_wait_policy

log = logging.getLogger("services.engine")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata engine", description="Run an engine replica (gRPC strata.v1.Engine).")
    add_engine_args(parser)
    parser.add_argument("--served-model-name", help="model name reported to clients (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50052, help="gRPC port, 0 for any (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (default: none)")
    parser.add_argument("--shutdown-timeout", type=float, default=60.0,
                        help="seconds running requests may take to finish after SIGTERM (the drain); what is left "
                             "then ends with UNAVAILABLE (default: %(default)s)")
    parser.add_argument("--nats-url", help="publish KV-cache events and load reports on this NATS server "
                        "(e.g. nats://127.0.0.1:4222), for the router (default: none, no events)")
    parser.add_argument("--advertise-address",
                        help="the host (name or IP) routers should dial, in the load reports (default: --host, or "
                             "this machine's name when --host is a wildcard; in a pod: its IP, $(POD_IP))")
    parser.add_argument("--load-report-interval", type=float, default=1.0,
                        help="seconds between load reports on NATS (default: %(default)s)")
    parser.add_argument("--log-stats-interval", type=float, default=10.0,
                        help="seconds between the stats lines logged while there is traffic (throughput, "
                             "running/waiting, KV cache usage, prefix cache hit rate) (default: %(default)s)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats lines (default: logged every --log-stats-interval)")
    parser.add_argument("--trace-steps", action="store_true",
                        help="one span per engine step (engine.step: batch size, prefill and decode tokens, step "
                             "time), linked to the spans of the requests it served; exported where traces are "
                             "(OTEL_EXPORTER_OTLP_ENDPOINT) (default: off)")
    parser.add_argument("--trace-steps-sample", type=float, default=1.0, metavar="RATIO",
                        help="fraction of the steps traced with --trace-steps, in (0, 1] (default: %(default)s)")
    add_tls_args(parser)
    add_logging_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tls = tls_from_args(args, parser)
    use_openmp_wait_policy()  # before the server's imports load torch
    setup_logging(args.log_level, args.log_format, service="strata-engine", instance=args.replica_id)
    config = with_local_model(config_from_args(args))
    if config.trust_remote_code:
        log.info("--trust-remote-code: accepted for vLLM's command lines; Strata runs no code from a checkpoint")
    if args.load_report_interval <= 0 or args.log_stats_interval <= 0:
        raise SystemExit("strata engine: --load-report-interval and --log-stats-interval must be > 0")
    if not 0 < args.trace_steps_sample <= 1:
        raise SystemExit(f"strata engine: --trace-steps-sample {args.trace_steps_sample:g} must be in (0, 1]: "
                         "the fraction of the steps traced")
    traced = setup_tracing("strata-engine", instance_id=args.replica_id)
    if args.trace_steps and not traced:
        log.warning("--trace-steps: no step spans, traces are not exported (set OTEL_EXPORTER_OTLP_ENDPOINT)")
    from services.engine.server import run_server

    try:
        run_server(config, args.host, args.port, args.served_model_name or args.model or config.model,
                   args.shutdown_timeout, args.metrics_port, args.nats_url, args.load_report_interval,
                   args.advertise_address, tls, None if args.disable_log_stats else args.log_stats_interval,
                   args.trace_steps_sample if args.trace_steps and traced else None)
    except (ValueError, FileNotFoundError) as error:  # the checkpoint's or a flag's: its message says which
        raise SystemExit(f"strata engine: {error}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
