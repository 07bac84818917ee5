"""``python -m services.common.health_probe HOST:PORT [--tls-ca CA --tls-cert C --tls-key K]``: exit
0 when the gRPC server there says SERVING (grpc.health.v1), 1 otherwise; for container health checks."""

import argparse

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.tls import TlsFiles, add_tls_args, sync_channel, tls_from_args


def serving(address: str, timeout_s: float = 3.0, tls: TlsFiles | None = None) -> bool:
    with sync_channel(address, tls) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.health_probe", description=__doc__)
    parser.add_argument("address", help="HOST:PORT of a Strata gRPC service")
    add_tls_args(parser)
    args = parser.parse_args(argv)
    return 0 if serving(args.address, tls=tls_from_args(args, parser)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
