"""``python -m services.common.health_probe HOST:PORT``: exit 0 when the gRPC server there says
SERVING (grpc.health.v1), 1 otherwise; for container health checks."""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def serving(address: str, timeout_s: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    return 0 if serving(args[0]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
