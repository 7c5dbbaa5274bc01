"""The router's side of the HTTP API (openai_api/): its own gRPC servicer, called in-process, so
an HTTP request is routed, failed over and resumed exactly as a gRPC one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from openai_api.backend import Backend, ServedModel, model_of
from openai_api.call_context import HttpCallContext
from openai_api.token_bytes import token_bytes as token_bytes_of
from pagedgen_api import generation_pb2 as pb
from router.core import Router
from router.servicer import RouterServicer


def router_backend(router: Router, servicer: RouterServicer) -> Backend:
    def models() -> list[ServedModel]:
        """The models the routable replicas serve (compatible replicas share one and its
        block size), each with the smallest context and KV pool among them: a request may go
        to any of them; prompts are checked against the largest, as the gRPC door does."""
        served: dict[str, ServedModel] = {}
        for replica in router.replicas.routable():
            model = model_of(replica.info)
            known = served.get(model.name)
            served[model.name] = ServedModel(
                model.name, model.max_model_len, model.kv_blocks, model.block_size,
                model.max_model_len) if known is None else ServedModel(
                model.name, min(known.max_model_len, model.max_model_len),
                min(known.kv_blocks, model.kv_blocks), model.block_size,
                max(known.widest_context, model.max_model_len))
        return sorted(served.values(), key=lambda m: m.name)

    async def token_texts(token_ids: list[int]) -> list[str]:
        tokenizer = router.prompts.local(router.replicas.routable())
        if tokenizer is not None:  # on the tokenizer's own thread (router/prompt.py)
            return await router.prompts.run(lambda: [tokenizer.decode([t]) for t in token_ids])
        replies = await asyncio.gather(*(
            servicer.Detokenize(pb.DetokenizeRequest(token_ids=[t], skip_special_tokens=False),
                                HttpCallContext())
            for t in token_ids))
        return [reply.text for reply in replies]

    # The local tokenizer's bytes function, made once per tokenizer: making it reads the whole
    # tokenizer's JSON (is its decoder byte-level?), too much for every request.
    made: list[tuple[object, Callable[[list[int]], list[bytes]]]] = []  # (tokenizer, function)

    async def token_bytes(token_ids: list[int]) -> list[bytes]:
        tokenizer = router.prompts.local(router.replicas.routable())
        if tokenizer is not None:  # on the tokenizer's own thread, as token_texts
            if not made or made[0][0] is not tokenizer:
                made[:] = [(tokenizer, token_bytes_of(tokenizer))]
            of = made[0][1]
            return await router.prompts.run(lambda: of(token_ids))
        return [text.encode() for text in await token_texts(token_ids)]  # no raw bytes here

    return Backend(servicer=servicer,
                   serving=lambda: router.serving and not servicer.draining,
                   models=models, token_texts=token_texts, token_bytes=token_bytes)
