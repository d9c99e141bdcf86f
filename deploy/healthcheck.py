"""Container health probe: ``python -m deploy.healthcheck HOST:PORT [SERVICE]``.

Exits 0 when ``grpc.health.v1.Health/Check`` answers SERVING, 1 otherwise
(used by the images' HEALTHCHECK and the compose file; Kubernetes uses its
native gRPC probes instead).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def probe(address: str, service: str = "", timeout: float = 2.0) -> bool:
    """True when ``service`` at ``address`` reports SERVING."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            print(f"{address} {service or '(overall)'}: {err.code().name}", file=sys.stderr)
            return False
    ok = bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    if not ok:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        print(f"{address} {service or '(overall)'}: {name}", file=sys.stderr)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    return 0 if probe(args[0], args[1] if len(args) == 2 else "") else 1


if __name__ == "__main__":
    raise SystemExit(main())
