"""The gRPC servers' connection bounds (prefix_index/tools/server_options.py): at most
--max-connections connections open at once (one past it is closed as soon as it is accepted,
the open ones served as before), and a connection with no call for --max-connection-idle-s is
sent GOAWAY (its client reconnects on its next call); 0 turns either off. Shown over loopback
against the installed grpcio, on the router in this process and on the three servers' real
command lines (engine, router, prefix index).

Each channel here asks for a connection of its own (grpc.use_local_subchannel_pool): grpcio
otherwise shares one connection among channels to the same address."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.serving import server as engine_server
from engine_service.serving.connection_limits import generation_limits
from engine_service.tools.launch import EngineProcess
from prefix_index.server import main as index_main
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from prefix_index.tools.server_options import DEFAULT_MAX_CONNECTION_IDLE_S, ConnectionLimits
from router import server as router_server
from router.config import RouterConfig
from router.core import Router
from router.server import RouterServer
from router.tools.launch import RouterProcess

OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
REFUSED_WITHIN_S = 3.0
SETTLE_S = 10.0


def own_channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=OWN_CONNECTION)


async def served(channel: grpc.aio.Channel, wait_for_ready: bool = False,
                 timeout_s: float = REFUSED_WITHIN_S) -> bool:
    """Whether a health check on `channel` is answered (any status: the server is up)."""
    try:
        await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=wait_for_ready)
        return True
    except grpc.aio.AioRpcError as error:
        assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        return False


async def cap_holds(target: str, cap: int) -> None:
    """`cap` connections are served, one more is refused while they stay open, they are still
    served after it, and a new one is served once one of them has closed."""
    channels = [own_channel(target) for _ in range(cap + 1)]
    try:
        for channel in channels[:cap]:  # (waits out a slot the launcher's probe still held)
            assert await served(channel, wait_for_ready=True, timeout_s=SETTLE_S)
        assert not await served(channels[cap]), f"connection {cap + 1} of a cap of {cap} served"
        for channel in channels[:cap]:
            assert await served(channel)
        # The refused channel goes first: it keeps retrying in the background, and would take
        # the slot freed next as often as the new channel does.
        await channels[cap].close()
        await channels[0].close()
        late = own_channel(target)
        channels.append(late)
        assert await served(late, wait_for_ready=True, timeout_s=SETTLE_S)
    finally:
        for channel in channels:
            await channel.close()


async def all_served(target: str, count: int) -> None:
    channels = [own_channel(target) for _ in range(count)]
    try:
        for channel in channels:
            assert await served(channel)
    finally:
        for channel in channels:
            await channel.close()


async def left_ready(channel: grpc.aio.Channel, within_s: float) -> bool:
    """Whether the channel's connection went away (GOAWAY: the channel turns IDLE) within."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if channel.get_state() != grpc.ChannelConnectivity.READY:
            return True
        await asyncio.sleep(0.05)
    return False


@contextlib.asynccontextmanager
async def router_on_loopback(**connection):
    """A router (no replica it can reach: health answers NOT_SERVING, which is an answer)."""
    router = Router(RouterConfig(), ["127.0.0.1:1"], None)
    server = RouterServer(router, port=0, **connection)
    await server.start()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)


def test_connections_past_the_cap_are_refused_and_the_open_ones_served():
    async def body() -> None:
        async with router_on_loopback(max_connections=3, max_connection_idle_s=0) as target:
            await cap_holds(target, 3)
        async with router_on_loopback(max_connections=0, max_connection_idle_s=0) as target:
            await all_served(target, 6)  # 0: no cap

    asyncio.run(body())


def test_a_connection_with_no_call_is_closed_after_the_idle_limit_and_the_client_reconnects():
    async def body() -> None:
        async with router_on_loopback(max_connection_idle_s=0.5) as target:
            async with own_channel(target) as channel:
                assert await served(channel)
                assert await left_ready(channel, within_s=5.0), "the idle connection stayed"
                assert await served(channel)  # a new connection, no error seen
            async with own_channel(target) as channel:  # a call open is not idle
                call = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(), timeout=30)
                await call.read()
                assert not await left_ready(channel, within_s=1.5)
                call.cancel()
        async with router_on_loopback(max_connection_idle_s=0) as target:  # 0: no limit
            async with own_channel(target) as channel:
                assert await served(channel)
                assert not await left_ready(channel, within_s=1.5)

    asyncio.run(body())


def test_the_options_carry_both_bounds_and_zero_turns_each_off():
    options = dict(generation_limits(4096, 64, max_connections=7,
                                     max_connection_idle_s=2.5).options())
    assert options["grpc.max_allowed_incoming_connections"] == 7
    assert options["grpc.max_connection_idle_ms"] == 2500
    off = dict(ConnectionLimits(1 << 20, -1, max_connections=0,
                                max_connection_idle_s=0).options())
    assert "grpc.max_allowed_incoming_connections" not in off
    assert "grpc.max_connection_idle_ms" not in off
    default = dict(ConnectionLimits(1 << 20, -1).options())  # bounded unless told otherwise
    assert default["grpc.max_allowed_incoming_connections"] > 0
    assert default["grpc.max_connection_idle_ms"] == DEFAULT_MAX_CONNECTION_IDLE_S * 1000
    index = dict(index_main.connection_limits(index_main.Limits(), 5, 1.0).options())
    assert (index["grpc.max_allowed_incoming_connections"],
            index["grpc.max_connection_idle_ms"]) == (5, 1000)


@pytest.mark.parametrize("parse", [
    lambda argv: engine_server.parse_args(["--insecure", *argv]),
    lambda argv: router_server.parse_args(["--insecure", "--engines", "127.0.0.1:1", *argv]),
    lambda argv: index_main.parse_args(["--insecure", *argv]),
], ids=["engine", "router", "index"])
def test_each_server_takes_both_flags_and_refuses_bad_values(parse, capsys):
    args = parse(["--max-connections", "0", "--max-connection-idle-s", "90"])
    assert (args.max_connections, args.max_connection_idle_s) == (0, 90.0)
    args = parse([])
    assert args.max_connections > 0
    assert args.max_connection_idle_s == DEFAULT_MAX_CONNECTION_IDLE_S
    for bad in (["--max-connections", "-1"], ["--max-connection-idle-s", "-1"],
                ["--max-connection-idle-s", "nan"]):
        with pytest.raises(SystemExit):
            parse(bad)
        assert bad[0] in capsys.readouterr().err


def test_the_index_cli_config_carries_the_flags():
    args = index_main.parse_args(["--insecure", "--max-connections", "3",
                                  "--max-connection-idle-s", "4"])
    config = index_main.config_from_args(args)
    assert (config.max_connections, config.max_connection_idle_s) == (3, 4.0)


CAP_ARGS = ["--insecure", "--max-connections", "2"]


def test_the_router_command_line_caps_its_connections():
    # Not started by its launcher, which waits for SERVING: no replica here, so it never is.
    router = RouterProcess([*CAP_ARGS, "--engines", "127.0.0.1:1"])
    router.spawn(router.command())
    try:
        asyncio.run(cap_holds(router.target, 2))  # (the first calls wait for it to listen)
    finally:
        router.kill()


def test_the_index_command_line_caps_its_connections():
    with RedisProcess() as redis, IndexProcess(redis.url, CAP_ARGS) as index:
        asyncio.run(cap_holds(index.target, 2))


def test_the_engine_command_line_caps_its_connections(tiny_llama_dir):
    with EngineProcess(tiny_llama_dir, [*CAP_ARGS, "--device", "cpu", "--num-blocks", "64",
                                        "--prefix-index", "none"]) as engine:
        asyncio.run(cap_holds(engine.target, 2))
