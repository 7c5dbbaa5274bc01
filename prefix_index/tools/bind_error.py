"""A server that cannot bind one of its ports says so in one line and exits 1 (the index, the
engine and the router alike), rather than a traceback or a crash while tearing down what it
had started."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from prefix_index.tools import metrics_server


class BindError(OSError):
    """A server's gRPC or metrics port could not be bound."""


def serve_metrics(registry: CollectorRegistry, port: int,
                  host: str) -> metrics_server.MetricsServer:
    """Start the Prometheus endpoint (call it before anything else runs); the server, for its
    service's stop() to stop."""
    try:
        return metrics_server.serve_metrics(registry, port, host)
    except OSError as error:
        raise BindError(f"metrics port {host}:{port}: {error.strerror or error}") from error


def bind_grpc(server, address: str, credentials=None) -> int:
    """server.add_secure_port with `credentials` (grpc.ServerCredentials), else
    add_insecure_port; its failure a BindError (grpcio raises RuntimeError, or returns 0 in
    older versions); returns the bound port."""
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError as error:
        raise BindError(f"gRPC port {address}: {error}") from error
    if port == 0:
        raise BindError(f"gRPC port {address}: could not bind")
    return port
