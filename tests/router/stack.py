"""The one stack of real processes the router, tenant, bounds and HTTP tests share: Redis, the
prefix index, N engines on the tiny Llama (each registering its serving address) and the router
in front of them, all over loopback, on the session's certificates as deployed: mutual TLS
between the services, TLS at the router's front door (tests/support/tls.py). Without the index
(with_index=False): the engines alone, the router given their addresses."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import grpc

from engine_service.core.block_hash import BlockHasher
from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from pagedgen_api import prefix_index_pb2 as pi_pb
from pagedgen_api import prefix_index_pb2_grpc as pi_grpc
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from router.tools.launch import RouterProcess
from tenancy.client import with_api_key
from tests.support.tls import SessionCerts
from trust.identity import INDEX_ROLE, ROUTER_ROLE

BLOCK_SIZE = 16
NUM_BLOCKS = 128


# The engines' pool and context unless a stack is given its own (engine_shape).
ENGINE_SHAPE = ("--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                "--max-model-len", "2048", "--dtype", "float32")


def engine_args(index_target: str, engine_id: str,
                shape: tuple[str, ...] | list[str] = ENGINE_SHAPE) -> list[str]:
    return [*shape, "--prefix-index", index_target,
            # The index lease is the shipped one (30 s): a replica killed and restarted under
            # its id must be taken back at once, not after its dead process's lease lapsed.
            "--engine-id", engine_id, "--grace-s", "2",
            "--log-level", "WARNING"]


class RouterStack:
    """Start with `with RouterStack(...) as stack:`; engines are named engine-0, engine-1, ..."""

    def __init__(self, model_dir: Path, log_dir: Path, certs: SessionCerts, num_engines: int = 2,
                 router_args: list[str] | None = None, with_index: bool = True,
                 with_router: bool = True, api_key: str | None = None,
                 engine_shape: list[str] | None = None) -> None:
        self.model_dir = model_dir
        self.certs = certs
        self.log_dir = log_dir
        self.num_engines = num_engines
        self.router_args = router_args or []
        self.with_index = with_index  # False: no Redis, no index (--prefix-index none)
        self.engine_shape = list(engine_shape or ENGINE_SHAPE)  # pool, context, dtype, ...
        self.with_router = with_router  # False: a test runs its own router (in its process)
        self.api_key = api_key  # the router's (--api-key / --api-key-file): channel() sends it
        self.engines: dict[str, EngineProcess] = {}
        self._stack = ExitStack()
        self.redis: RedisProcess | None = None
        self.index: IndexProcess | None = None
        self.router: RouterProcess | None = None

    def __enter__(self) -> RouterStack:
        try:
            if self.with_index:
                self.redis = self._stack.enter_context(RedisProcess())
                self.index = IndexProcess(self.redis.url, ["--log-level", "WARNING"],
                                          tls=self.certs.files("index"))
                self._stack.enter_context(self.index)
            self._stack.callback(self._stop_engines)
            # Launched together, then waited for: their starts overlap.
            for i in range(self.num_engines):
                self.start_engine(f"engine-{i}", wait=False)
            for engine in self.engines.values():
                engine.wait_serving()
            if self.with_router:
                self.start_router()
        except BaseException:
            # (A router that started and then failed its wait is not on the stack: it was
            # left running after its test.)
            if self.router is not None:
                self.router.kill()
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.router is not None:
            self.router.kill()
        self._stack.close()

    def _stop_engines(self) -> None:
        for engine in self.engines.values():
            engine.kill()

    def start_engine(self, engine_id: str, port: int | None = None,
                     wait: bool = True) -> EngineProcess:
        """`wait`: until it serves; else launched only (wait_serving() later)."""
        index_target = self.index.target if self.index is not None else "none"
        engine = EngineProcess(self.model_dir,
                               engine_args(index_target, engine_id, self.engine_shape),
                               port=port, log_path=self.log_dir / f"{engine_id}.log",
                               tls=self.certs.files("engine"))
        engine.launch()
        self.engines[engine_id] = engine  # (killed with the stack from now on)
        if wait:
            engine.wait_serving()
        return engine

    def restart_index(self, port: int) -> IndexProcess:
        """A new index process on `port` (the old one killed), stopped with the stack."""
        self.index = self._stack.enter_context(
            IndexProcess(self.redis.url, ["--log-level", "WARNING"], port=port,
                         tls=self.certs.files("index")))
        return self.index

    def restart_dead_engines(self) -> None:
        """Every engine up again, each dead one at its old port (a test before on this
        worker may have killed some)."""
        for engine_id, engine in list(self.engines.items()):
            if engine.proc is None or engine.proc.poll() is not None:
                self.start_engine(engine_id, port=engine.port)

    def kill_engine(self, engine_id: str) -> None:
        self.engines[engine_id].kill()

    def start_router(self) -> RouterProcess:
        args = ["--stats-interval-s", "0.05", "--discovery-interval-s", "0.2",
                "--log-level", "INFO", *self.router_args]
        if self.with_index:
            args += ["--prefix-index", self.index.target]
        else:
            args += ["--engines", ",".join(e.target for e in self.engines.values())]
        self.router = RouterProcess(args, log_path=self.log_dir / "router.log",
                                    tls=self.certs.files("router"))
        self.router.start()
        self.wait_routable(len(self.engines))
        return self.router

    def channel(self, target: str | None = None) -> grpc.Channel:
        """A channel to the router, an end client's (TLS verifying the CA, no certificate), or
        to `target` (an engine: mutual TLS, a client certificate); with the router's API key
        if it takes one."""
        if target is None or target == self.router.target:
            return with_api_key(self.certs.end_client_channel(self.router.target), self.api_key)
        return with_api_key(self.certs.channel(target), self.api_key)

    def lookup(self, chain: list[bytes]) -> dict[str, int]:
        return lookup(self.index.target, chain, self.certs)

    def router_stats(self) -> pb.EngineStatsResponse:
        with self.channel() as channel:
            return pb_grpc.GenerationStub(channel).EngineStats(pb.EngineStatsRequest(),
                                                               timeout=10)

    def wait_routable(self, count: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            details = self.router_stats().index_details
            if int(details.get("replicas_routable", "0")) == count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"router: {count} routable replicas expected, "
                                   f"got {dict(details)}")
            time.sleep(0.05)

    def router_log(self) -> str:
        path = self.log_dir / "router.log"
        return path.read_text() if path.exists() else ""


# ---- what the tests ask of a running stack -------------------------------------------------
def generate(stub: pb_grpc.GenerationStub, ids: list[int], max_tokens: int = 8,
             cache_salt: str = "", request_id: str = "") -> tuple[pb.GenerateResponse, list[str]]:
    """Greedy Generate through `stub`; returns the reply and the replicas that ran it."""
    reply, call = generate_call(stub, ids, max_tokens, cache_salt, request_id)
    return reply, served_by(call)


def generate_call(stub: pb_grpc.GenerationStub, ids: list[int], max_tokens: int = 8,
                  cache_salt: str = "", request_id: str = "") -> tuple[pb.GenerateResponse, object]:
    """Greedy Generate through `stub`; returns the reply and the call (its trailing metadata)."""
    request = pb.GenerateRequest(
        request_id=request_id, token_ids=pb.TokenIds(ids=ids), cache_salt=cache_salt,
        sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return stub.Generate.with_call(request, timeout=60)


def served_by(call) -> list[str]:
    metadata = dict(call.trailing_metadata() or ())
    return [name for name in metadata.get("pagedgen-replicas", "").split(",") if name]


def routed_by(call) -> list[str]:
    """The policy that chose each replica of `served_by`, e.g. kv-aware,
    prefix-hash-bounded-fallback."""
    metadata = dict(call.trailing_metadata() or ())
    return [name for name in metadata.get("pagedgen-route", "").split(",") if name]


def generate_kv_routed(stub: pb_grpc.GenerationStub, ids: list[int], holders: set[str],
                       max_tokens: int = 8, timeout_s: float = 20.0
                       ) -> tuple[pb.GenerateResponse, list[str], set[str]]:
    """Greedy Generate, sent again while the router routed it by the prefix-hash-bounded fallback.

    The router gives a Lookup 250 ms, then routes by prefix-hash-bounded until the index answers:
    legitimate on a starved machine, but such a request says nothing of cache affinity. Returns
    the first reply routed by kv-aware, its replicas, and `holders` (the replicas holding the
    prompt's prefix) plus where the fallback requests ran: they hold it too now.
    """
    holders = set(holders)
    deadline = time.monotonic() + timeout_s
    while True:
        reply, call = generate_call(stub, ids, max_tokens)
        routes = routed_by(call)
        if routes == ["kv-aware"]:
            return reply, served_by(call), holders
        assert routes and all(r == "prefix-hash-bounded-fallback" for r in routes), routes
        holders.update(served_by(call))
        if time.monotonic() > deadline:
            raise AssertionError(f"every request for {timeout_s}s was routed by the fallback")
        time.sleep(0.1)


def lookup(index_target: str, chain: list[bytes], certs: SessionCerts) -> dict[str, int]:
    """engine id -> leading blocks of chain it holds, as the index says (asked as a router: the
    index lets only routers read)."""
    with certs.channel(index_target, ROUTER_ROLE, INDEX_ROLE) as channel:
        reply = pi_grpc.PrefixIndexStub(channel).Lookup(pi_pb.LookupRequest(chain=chain),
                                                        timeout=5)
    return {m.engine_id: m.matched_blocks for m in reply.engines}


def wait_until(predicate, timeout_s: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached after {timeout_s}s")
        time.sleep(0.05)


def hasher_of(stub: pb_grpc.GenerationStub) -> BlockHasher:
    info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
    return BlockHasher.for_identity(info.model_identity, info.block_size)
