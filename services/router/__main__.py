"""``python -m services.router --port 50060 --engine-addrs H:P,H:P [--nats-url nats://H:P]`` (also
``strata router ...``): one `strata.v1.Engine` address in front of many engine replicas."""

import argparse

import uvloop

from services.common.block_hash import DEFAULT_HASH_SEED
from services.common.gc_heap import freeze_startup_heap
from services.common.logging_setup import add_logging_args, setup_logging
from services.common.nats_auth import is_authenticated
from services.common.telemetry import setup_tracing
from services.common.tls import add_tls_args, tls_from_args
from services.router.policy import POLICIES
from services.router.server import serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50060, help="port, 0 for any free one (default: %(default)s)")
    parser.add_argument("--engine-addrs", default="",
                        help="comma-separated host:port of the engine replicas (more can join by their load reports on "
                             "an authenticated NATS) (default: none: only those that join)")
    parser.add_argument("--nats-url", help="follow the engines' KV events and load reports here; without it, "
                        "routing is by load (polled) alone (default: none)")
    parser.add_argument("--prefix-cache-hash-seed", type=int, default=DEFAULT_HASH_SEED,
                        help="the engines' --prefix-cache-hash-seed (default: %(default)s)")
    parser.add_argument("--router-id", default="router-0", help="this router's id in Info and Load (default: %(default)s)")
    parser.add_argument("--health-check-interval", type=float, default=1.0,
                        help="seconds between replica health checks (default: %(default)s)")
    parser.add_argument("--forget-after", type=float, default=30.0,
                        help="seconds a replica that joined by its NATS load reports may stay down before it is "
                             "forgotten (replicas of --engine-addrs are kept) (default: %(default)s)")
    parser.add_argument("--max-joined-replicas", type=int, default=64,
                        help="most replicas that may join by their NATS load reports (default: %(default)s)")
    parser.add_argument("--policy", default="cache-aware", choices=POLICIES,
                        help="cache-aware: most prefix-cache overlap while the load is balanced, least load "
                             "otherwise; round-robin: neither (a baseline) (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (default: none)")
    parser.add_argument("--shutdown-timeout", type=float, default=60.0,
                        help="seconds the streams it relays may take to finish after SIGTERM; new requests are "
                             "refused meanwhile (default: %(default)s)")
    parser.add_argument("--max-attempts", type=int, default=3,
                        help="replicas a request may try when they fail before its first token (default: %(default)s)")
    parser.add_argument("--migration-limit", type=int, default=0,
                        help="times a stream whose replica fails mid-way may go on on another replica, the tokens "
                             "so far appended to its prompt (Dynamo's flag; services/router/migration.py); 0: the "
                             "client sees the cut (default: %(default)s)")
    add_tls_args(parser)  # served to the gateway, and presented to (and verifying) the engines
    add_logging_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tls = tls_from_args(args, parser)
    addresses = [a.strip() for a in args.engine_addrs.split(",") if a.strip()]
    if not addresses and not (args.nats_url and is_authenticated(args.nats_url)):
        parser.error("give --engine-addrs, or --nats-url with NATS credentials (STRATA_NATS_TOKEN or "
                     "STRATA_NATS_TOKEN_FILE) for engines that announce themselves")
    if args.health_check_interval <= 0 or args.max_attempts < 1 or args.migration_limit < 0:
        parser.error("--health-check-interval must be > 0, --max-attempts >= 1 and --migration-limit >= 0")
    setup_logging(args.log_level, args.log_format, service="strata-router", instance=args.router_id)
    setup_tracing("strata-router", instance_id=args.router_id)
    freeze_startup_heap(f"router {args.router_id}")
    uvloop.run(serve(args.host, args.port, addresses, args.nats_url, args.router_id, args.prefix_cache_hash_seed,
                     args.health_check_interval, args.max_attempts, args.policy, args.metrics_port,
                     args.forget_after, args.max_joined_replicas, args.shutdown_timeout, tls,
                     migration_limit=args.migration_limit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
