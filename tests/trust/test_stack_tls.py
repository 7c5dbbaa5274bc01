"""Real processes over loopback, every link TLS with certificates from pagedgen-certs: Redis,
the prefix index (mutual TLS), two engines (mutual TLS, each registering under the id its
certificate names) and the router (TLS front door; mutual TLS to the index and the engines)."""

from __future__ import annotations

import json
import re
import shlex
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest

from engine_service.core.block_hash import BlockHasher
from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from pagedgen_api import prefix_index_pb2 as pi_pb
from pagedgen_api import prefix_index_pb2_grpc as pi_grpc
from prefix_index.tools.redis_process import free_port
from prefix_index.tools.server_process import wait_serving
from router.tools.launch import RouterProcess
from tenancy.keys_tool import add_key
from tests.trust.conftest import files, make_certs
from trust.cli_args import tls_argv
from trust.credentials import channel_options

ENGINE_ARGS = ["--num-blocks", "128", "--block-size", "16", "--max-model-len", "512",
               "--grace-s", "1", "--log-level", "WARNING", "--dtype", "float32"]
ROUTER_ARGS = ["--stats-interval-s", "0.05", "--discovery-interval-s", "0.2",
               "--log-level", "INFO"]


class TlsStack:
    def __init__(self, model_dir, certs, index, log_dir) -> None:
        self.model_dir, self.certs, self.index, self.log_dir = model_dir, certs, index, log_dir
        self.engines: dict[str, EngineProcess] = {}
        self.http_port = free_port()
        self.router: RouterProcess | None = None

    def start_engine(self, engine_id: str, port: int | None = None) -> EngineProcess:
        args = [*ENGINE_ARGS, "--engine-id", engine_id, "--prefix-index", self.index.target]
        engine = EngineProcess(self.model_dir, args, port=port,
                               log_path=self.log_dir / f"{engine_id}.log",
                               tls=files(self.certs, f"engine-{engine_id}"))
        engine.start()
        self.engines[engine_id] = engine
        return engine

    def start_rogue(self, engine_id: str, stem: str) -> EngineProcess:
        """An engine serving with the `stem` certificate, which is not an engine's (the
        launcher's own check would wait for an engine's: asked here by its host name)."""
        rogue_files = files(self.certs, stem)
        engine = EngineProcess(self.model_dir, [*ENGINE_ARGS, "--engine-id", engine_id,
                                                *tls_argv(rogue_files)],
                               log_path=self.log_dir / f"{engine_id}.log")
        self.engines[engine_id] = engine
        engine.spawn(engine.command(), engine.log_path)
        wait_serving(engine.target, 120.0, name=engine_id, proc=engine.proc,
                     log_path=engine.log_path, tls=rogue_files.load())
        return engine

    def start_router(self, extra: list[str], name: str = "router") -> RouterProcess:
        router = RouterProcess([*ROUTER_ARGS, *extra], log_path=self.log_dir / f"{name}.log",
                               tls=files(self.certs, "router"))
        return router.start()

    def client(self, target: str) -> grpc.Channel:
        """An end client: trusts the CA, presents no certificate."""
        ca = (self.certs / "ca.pem").read_bytes()
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(ca))

    def router_details(self, router: RouterProcess) -> dict[str, str]:
        with self.client(router.target) as channel:
            return dict(pb_grpc.GenerationStub(channel).EngineStats(
                pb.EngineStatsRequest(), timeout=10).index_details)

    def wait_routable(self, router: RouterProcess, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while int(self.router_details(router).get("replicas_routable", "0")) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} routable replicas expected: "
                                   f"{self.router_details(router)}")
            time.sleep(0.1)

    def registered_epoch(self, engine_id: str) -> int | None:
        """engine_id's epoch at the index, read with the router's certificate (None: not
        registered, e.g. between a lapsed lease and the next registration)."""
        tls = files(self.certs, "router").load()
        with grpc.secure_channel(self.index.target, tls.channel_credentials(),
                                 options=channel_options("index")) as channel:
            try:
                reply = pi_grpc.PrefixIndexStub(channel).Stats(pi_pb.StatsRequest(
                    engine_id=engine_id), timeout=10)
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    return None
                raise
        return reply.engines[0].epoch if reply.engines else None


def generate(channel: grpc.Channel, ids: list[int]) -> tuple[pb.GenerateResponse, list[str]]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True))
    reply, call = pb_grpc.GenerationStub(channel).Generate.with_call(request, timeout=60)
    served = dict(call.trailing_metadata() or ()).get("pagedgen-replicas", "")
    return reply, [name for name in served.split(",") if name]


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, certs, tls_index, tmp_path_factory):
    running = TlsStack(tiny_llama_dir, certs, tls_index, tmp_path_factory.mktemp("tls-stack"))
    with ExitStack() as exits:
        for engine_id in ("stack-0", "stack-1"):
            exits.callback(lambda e=engine_id: running.engines[e].kill()
                           if e in running.engines else None)
            running.start_engine(engine_id)
        running.router = running.start_router(["--prefix-index", tls_index.target,
                                               "--http-port", str(running.http_port)])
        exits.callback(running.router.kill)
        running.wait_routable(running.router, 2)
        yield running


def test_a_request_is_served_end_to_end_over_tls(stack):
    with stack.client(stack.router.target) as channel:
        reply, served = generate(channel, list(range(10, 60)))
    assert reply.usage.completion_tokens == 4
    assert served and set(served) <= {"stack-0", "stack-1"}
    assert stack.router_details(stack.router)["index_up"] == "true"
    # The HTTP front serves HTTPS with the same certificate.
    trusting_ca = ssl.create_default_context(cafile=str(stack.certs / "ca.pem"))
    with urllib.request.urlopen(f"https://127.0.0.1:{stack.http_port}/v1/models",
                                context=trusting_ca, timeout=30) as reply:
        assert reply.status == 200 and b'"data"' in reply.read()


def test_plain_text_clients_are_refused(stack):
    for target in (stack.router.target, stack.engines["stack-0"].target, stack.index.target):
        with grpc.insecure_channel(target) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/v1/models", timeout=10)


def test_an_engine_refuses_a_client_without_a_certificate(stack):
    """Engines behind a router take only callers with a certificate (mutual TLS)."""
    with stack.client(stack.engines["stack-0"].target) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_router_refuses_a_replica_without_an_engine_certificate(stack):
    """A replica serving with a client's certificate (one the CA signed, not an engine's) is
    never routable; the engine beside it serves every request."""
    rogue = stack.start_rogue("rogue", stem="client")
    router = stack.start_router(["--engines", f"{stack.engines['stack-0'].target},"
                                              f"{rogue.target}",
                                 "--policy", "round-robin"], name="router-static")
    try:
        stack.wait_routable(router, 1)
        time.sleep(1.0)  # several polls of both replicas
        details = stack.router_details(router)
        assert details["replicas_routable"] == "1", details
        rogue_state = [v for v in details.values() if v.startswith(rogue.target)]
        assert rogue_state and "down" in rogue_state[0], details
        with stack.client(router.target) as channel:
            for start in range(6):
                _, served = generate(channel, list(range(start, start + 40)))
                assert served == ["stack-0"], served
    finally:
        router.kill()
        stack.engines.pop("rogue").kill()


def test_an_engine_restarted_with_a_new_certificate_rejoins(stack):
    """stack-1 killed, its certificate and key issued anew by the same CA, started again on its
    port under its id: the index takes it back (a new epoch) and the router routes to it."""
    old = stack.engines["stack-1"]
    port, epoch = old.port, stack.registered_epoch("stack-1")
    assert epoch is not None
    old_cert = (stack.certs / "engine-stack-1.pem").read_bytes()
    old.kill()
    for name in ("engine-stack-1.pem", "engine-stack-1-key.pem"):
        (stack.certs / name).unlink()
    make_certs(stack.certs, "--engine", "stack-1")
    assert (stack.certs / "engine-stack-1.pem").read_bytes() != old_cert
    stack.start_engine("stack-1", port=port)
    # The router may see the new process at the old address before the index has taken its
    # registration (the engine registers once it serves; the index first asks the old
    # holder's address who answers there): wait for both.
    deadline = time.monotonic() + 60
    while stack.registered_epoch("stack-1") in (None, epoch):
        assert time.monotonic() < deadline, "the restarted engine never registered again"
        time.sleep(0.1)
    assert stack.registered_epoch("stack-1") > epoch
    stack.wait_routable(stack.router, 2)
    served: set[str] = set()
    with stack.client(stack.router.target) as channel:
        for start in range(12):
            served.update(generate(channel, list(range(100 + 7 * start, 150 + 7 * start)))[1])
            if "stack-1" in served:
                break
    assert "stack-1" in served


def test_the_index_restarted_with_a_new_certificate_is_rejoined(stack):
    """The index killed, its certificate and key issued anew by the same CA, started again on
    its port and Redis: the engines' links and the router reconnect (they check the index's
    role, not its key), an engine's new blocks reach it, and the router routes by it: a
    prompt served after the restart goes back to the engine holding it, its blocks cached."""
    index = stack.index
    old_cert = (stack.certs / "index.pem").read_bytes()
    index.kill()
    for name in ("index.pem", "index-key.pem"):
        (stack.certs / name).unlink()
    make_certs(stack.certs, "--index")
    assert (stack.certs / "index.pem").read_bytes() != old_cert
    index.start()
    deadline = time.monotonic() + 60
    while stack.router_details(stack.router).get("index_up") != "true":
        assert time.monotonic() < deadline, "the router never reached the new index"
        time.sleep(0.1)
    prompt = list(range(300, 380))  # five full blocks
    with stack.client(stack.router.target) as channel:
        _, [holder] = generate(channel, prompt)
        info = pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=10)
        chain = BlockHasher.for_identity(info.model_identity, info.block_size).chain(
            prompt, None)
        tls = files(stack.certs, "router").load()
        with grpc.secure_channel(index.target, tls.channel_credentials(),
                                 options=channel_options("index")) as index_channel:
            lookup = pi_grpc.PrefixIndexStub(index_channel).Lookup
            while {m.engine_id: m.matched_blocks for m in lookup(
                    pi_pb.LookupRequest(chain=chain), timeout=10).engines}.get(holder) != 5:
                assert time.monotonic() < deadline, f"{holder}'s blocks never reached the index"
                time.sleep(0.1)
        again, served = generate(channel, prompt)
    assert served == [holder]
    assert again.usage.cached_tokens >= 64


def test_the_readmes_tls_grpcurl_commands_work_as_written(stack, tmp_path):
    """docs/security.md's TLS section, with this stack's certificates and addresses put in,
    against a router holding a key file: KEY is a key of it, and the same Generate with
    another key is refused (the -H header is what lets it in)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    section = text[text.index("## TLS and certificates"):]
    block = re.search(r"```console\n(.*?)```", section, flags=re.S).group(1)
    commands = [line for line in block.splitlines() if line.startswith("grpcurl ")]
    assert len(commands) == 3
    key_file = tmp_path / "api-keys.toml"
    key = add_key(key_file, "docs", settings={"may_read_stats": True})  # for the poll below
    router = stack.start_router(["--prefix-index", stack.index.target,
                                 "--api-key-file", str(key_file)], name="router-keys")
    try:
        with stack.client(router.target) as channel:
            deadline = time.monotonic() + 60
            while int(pb_grpc.GenerationStub(channel).EngineStats(
                    pb.EngineStatsRequest(), metadata=(("authorization", f"Bearer {key}"),),
                    timeout=10).index_details.get("replicas_routable", "0")) != 2:
                assert time.monotonic() < deadline, "the keyed router never routed to both"
                time.sleep(0.1)

        def run(command: str, api_key: str) -> subprocess.CompletedProcess:
            command = (command.replace("certs/", f"{stack.certs}/")
                       .replace("localhost:50050", router.target)
                       .replace("localhost:50051", stack.engines["stack-0"].target)
                       .replace("Bearer KEY", f"Bearer {api_key}"))
            return subprocess.run(shlex.split(command), capture_output=True, text=True,
                                  timeout=60)

        outputs = []
        for command in commands:
            done = run(command, key)
            assert done.returncode == 0, f"{command}\n{done.stderr}"
            outputs.append(done.stdout)
        assert "pagedgen.generation.v1.Generation" in outputs[0]
        assert json.loads(outputs[1])["usage"]["completion_tokens"] == 4  # (proto names)
        assert json.loads(outputs[2])["engine_id"] == "stack-0"
        assert "Bearer KEY" in commands[1]
        refused = run(commands[1], "not-a-key")
        assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stderr
    finally:
        router.kill()
