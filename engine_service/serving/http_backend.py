"""The engine's side of the HTTP API (openai_api/): its own gRPC servicer, called in-process."""

from __future__ import annotations

from engine_service.serving.servicer import GenerationServicer
from openai_api.backend import Backend, ServedModel
from openai_api.token_bytes import token_bytes


def engine_backend(servicer: GenerationServicer) -> Backend:
    info = servicer.engine.info
    limits = info.limits
    model = ServedModel(info.served_model_name, limits.max_model_len, limits.num_blocks,
                        limits.block_size)
    tokenizer = servicer.validator.tokenizer

    async def token_texts(token_ids: list[int]) -> list[str]:
        if tokenizer is None:  # --skip-tokenizer-init: ids are all there is
            return [f"token_id:{t}" for t in token_ids]
        # On the loop, like the servicer's own tokenizing: this tokenizer is the front's.
        return [tokenizer.decode([t]) for t in token_ids]

    of = token_bytes(tokenizer) if tokenizer is not None else None

    async def raw_bytes(token_ids: list[int]) -> list[bytes]:
        return of(token_ids)

    return Backend(servicer=servicer, serving=lambda: not servicer.draining,
                   models=lambda: [model], token_texts=token_texts,
                   token_bytes=raw_bytes if of is not None else None)
