"""Replicas behind one router must serve one model: one that serves another (another name,
weights, dtype or block size) is not routed to, and the router's health says why, not just
"incompatible"."""

from __future__ import annotations

import asyncio

from pagedgen_api import generation_pb2 as pb
from router.config import RouterConfig
from router.core import Router

FIRST, OTHER = "127.0.0.1:7101", "127.0.0.1:7102"


def test_a_replica_serving_another_model_is_not_routed_and_says_why():
    async def body() -> dict[str, str]:
        router = Router(RouterConfig(), [FIRST, OTHER], None)
        await router.replicas.set_members({FIRST: "", OTHER: ""})
        replicas = router.replicas.replicas
        for address, name in ((FIRST, "model-a"), (OTHER, "model-b")):
            router.replicas._adopt(replicas[address], pb.ModelInfoResponse(
                served_model_name=name, model_identity=f"{name}:abc:Llama", block_size=16,
                max_model_len=2048))
            replicas[address].healthy, replicas[address].last_error = True, ""
        routable = [r.address for r in router.replicas.routable()]
        details = router.details()
        for replica in replicas.values():
            await replica.close()
        assert routable == [FIRST]
        return details

    details = asyncio.run(body())
    assert details["replicas_routable"] == "1"
    other = next(v for k, v in details.items() if k.startswith("replica.") and OTHER in v)
    assert "serves model-b:abc:Llama" in other and "model-a:abc:Llama" in other
    assert "must serve one model" in other
