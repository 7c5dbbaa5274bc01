"""host:port strings for gRPC targets and bind addresses, IPv6 hosts included."""


def join_host_port(host: str, port: int) -> str:
    """'127.0.0.1', 50051 -> '127.0.0.1:50051'; '::1' -> '[::1]:50051' (an unbracketed IPv6
    host is ambiguous: gRPC reads '::1:50051' as a host with no port)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
