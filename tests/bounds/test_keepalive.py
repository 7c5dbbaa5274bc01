"""Keepalive enforcement (prefix_index/tools/server_options.py): a client pinging faster than
once every 10 s is sent GOAWAY ("too_many_pings") and its connection dropped, while a client
that does not flood keeps its connection."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.bounds.conftest import wait_until

FLOOD = [("grpc.keepalive_time_ms", 500), ("grpc.keepalive_permit_without_calls", 1),
         ("grpc.http2.max_pings_without_data", 0)]


def connected(bounded, target: str, options) -> tuple[grpc.Channel, list[str]]:
    channel = bounded.channel(target, options)
    states: list[str] = []
    channel.subscribe(lambda state: states.append(state.name), try_to_connect=True)
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    return channel, states


def sent_away(states: list[str]) -> bool:
    """READY, then IDLE: the server's GOAWAY dropped the connection."""
    return "READY" in states and "IDLE" in states[states.index("READY"):]


@pytest.mark.parametrize("front", ["engine", "router"])
def test_a_ping_flood_is_sent_away_and_others_keep_their_connection(bounded, front):
    target = bounded.engine.target if front == "engine" else bounded.router.target
    polite, polite_states = connected(bounded, target, [])
    flood, flood_states = connected(bounded, target, FLOOD)
    try:
        # READY, then dropped by the server's GOAWAY: IDLE until it connects again.
        wait_until(lambda: sent_away(flood_states), "the flooding client sent away",
                   timeout_s=60)
        assert polite_states[-1] == "READY"
        health_pb2_grpc.HealthStub(polite).Check(health_pb2.HealthCheckRequest(), timeout=30)
    finally:
        polite.close()
        flood.close()
