"""Every server's Prometheus port binds where the server binds unless told otherwise: its
counters carry no key, so a server on loopback (the default --host) must not serve them to
the network (they bound 0.0.0.0 whatever --host said)."""

from __future__ import annotations

import pytest

from engine_service.serving.server import parse_args as engine_args
from prefix_index.server.main import parse_args as index_args
from router.server import parse_args as router_args

SERVERS = {"engine": (engine_args, []), "router": (router_args, ["--engines", "e:1"]),
           "index": (index_args, [])}


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_the_metrics_port_binds_where_the_server_binds_unless_told(server):
    parse, required = SERVERS[server]
    base = [*required, "--insecure", "--metrics-port", "9100"]
    assert parse(base).metrics_host == "127.0.0.1"  # the shipped --host
    assert parse([*base, "--host", "0.0.0.0"]).metrics_host == "0.0.0.0"  # a container's
    assert parse([*base, "--host", "0.0.0.0", "--metrics-host", "10.1.2.3"]
                 ).metrics_host == "10.1.2.3"
    # IPv6 as --host may write it (its gRPC and HTTP ports take the brackets): Prometheus'
    # server does not, and the server failed to start.
    assert parse([*base, "--host", "[::1]"]).metrics_host == "::1"
    assert parse([*base, "--host", "::"]).metrics_host == "::"

