"""The router's HTTP model: replicas of one model with different contexts list the smallest
(a request may land on any), while a prompt's length is checked against the largest, as the
router's gRPC door checks it: the HTTP door refused what the gRPC door let through."""

from __future__ import annotations

from types import SimpleNamespace

from openai_api.to_engine import check_token_count
from pagedgen_api import generation_pb2 as pb
from router.http_backend import router_backend


def replica(max_model_len: int, num_blocks: int) -> SimpleNamespace:
    return SimpleNamespace(info=pb.ModelInfoResponse(
        served_model_name="m", max_model_len=max_model_len, num_blocks=num_blocks,
        block_size=16))


def test_prompts_are_checked_against_the_widest_replica():
    replicas = [replica(2048, 500), replica(8192, 300)]
    router = SimpleNamespace(replicas=SimpleNamespace(routable=lambda: replicas))
    backend = router_backend(router, servicer=SimpleNamespace(draining=False))
    [model] = backend.models()
    assert (model.max_model_len, model.kv_blocks, model.prompt_context) == (2048, 300, 8192)
    check_token_count("prompt", [1] * 4000, model.prompt_context)  # the gRPC door takes it
    [alone] = router_backend(SimpleNamespace(replicas=SimpleNamespace(
        routable=lambda: replicas[:1])), servicer=SimpleNamespace(draining=False)).models()
    assert alone.prompt_context == 2048
