"""An engine says SERVING once its index link's first round has ended: registered (the index
counts its first requests' prefixes, routers list it), or failed (it serves on its local LRU).
Real pagedgen-engine processes on the tiny model; the index is a dead port or a socket that
takes connections and never answers (test_index_integration covers a live index)."""

from __future__ import annotations

import socket

import pytest

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from tests.service.index_fixtures import prompt_ids

pytestmark = pytest.mark.timeout(120)

ENGINE_ARGS = ["--num-blocks", "64", "--block-size", "16", "--max-model-len", "512",
               "--log-level", "WARNING", "--grace-s", "1"]


def _index_details_at_serving(model_dir, index_target: str, tmp_path, certs) -> tuple:
    """EngineProcess returns at the first health SERVING: the engine's stats right then, and a
    4-token greedy reply after."""
    args = [*ENGINE_ARGS, "--prefix-index", index_target, "--engine-id", "engine-first"]
    with EngineProcess(model_dir, args, log_path=tmp_path / "engine.log",
                       tls=certs.files("engine")) as engine:
        with certs.channel(engine.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            stats = stub.EngineStats(pb.EngineStatsRequest(), timeout=10)
            reply = stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt_ids(seed=40, length=20)),
                sampling=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
                timeout=60)
    return stats, reply, (tmp_path / "engine.log").read_text()


def test_an_engine_whose_index_is_down_serves_on_its_local_lru(tiny_llama_dir, tmp_path,
                                                               test_certs):
    """A refused connection ends the first round at once: SERVING, degraded, having tried."""
    stats, reply, _ = _index_details_at_serving(
        tiny_llama_dir, f"127.0.0.1:{free_port()}", tmp_path, test_certs)
    assert stats.degraded and stats.index_details["state"] == "degraded"
    assert stats.index_details["registrations"] == "0"
    assert len(reply.completions[0].token_ids) == 4


def test_health_waits_out_an_index_that_does_not_answer(tiny_llama_dir, tmp_path,
                                                        test_certs):
    """An index that takes the connection and says nothing holds SERVING back until the
    Register call's deadline (3 s; the wait's own bound is 5 s): health never says
    SERVING while the link is still starting (grpc's health servicer says SERVING for "" from
    its creation, so it did as soon as the port served)."""
    with socket.socket() as silent:  # listens, never accepts: the handshake never ends
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        stats, reply, log = _index_details_at_serving(tiny_llama_dir, target, tmp_path,
                                                      test_certs)
    assert stats.index_details["state"] == "degraded", dict(stats.index_details)
    assert stats.index_details["registrations"] == "0"
    assert len(reply.completions[0].token_ids) == 4
    # The Register deadline ended the round, not the wait's own bound.
    assert "has not answered the engine's registration" not in log
