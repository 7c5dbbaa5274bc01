"""The router's local tokenizer check (router/prompt.py) while discovery swaps the engine at a
replica's address: the check finishes for the identity it started with."""

from __future__ import annotations

import asyncio
import time
import types

import router.prompt as prompt_module
from pagedgen_api import generation_pb2 as pb
from router.prompt import PromptReader
from router.replicas import Replica


def test_the_tokenizer_check_survives_the_replicas_info_being_reset(monkeypatch, tmp_path):
    def slow_tokenizer(config):  # loading takes a while: discovery runs meanwhile
        time.sleep(0.2)
        return "tokenizer"

    monkeypatch.setattr(prompt_module, "load_model_config", lambda path: None)
    monkeypatch.setattr(prompt_module, "load_tokenizer", slow_tokenizer)
    monkeypatch.setattr(prompt_module, "chat_token_ids", lambda tokenizer, chat: [1, 2])

    async def body():
        replica = Replica("127.0.0.1:1", "e1")
        replica.info = pb.ModelInfoResponse(model_identity="m", model_path=str(tmp_path))

        async def tokenize(request, timeout):  # the replica agrees with the local tokenizer
            return types.SimpleNamespace(token_ids=[1, 2])

        replica.stub = types.SimpleNamespace(Tokenize=tokenize)
        reader = PromptReader(None, 1.0)
        reader.prepare(replica)
        await asyncio.sleep(0.05)
        replica.info = None  # ReplicaSet.set_members: another engine id at the address
        await reader._loading
        replica.info = pb.ModelInfoResponse(model_identity="m", model_path=str(tmp_path))
        assert reader.source == "local" and reader.identity == "m"
        assert reader.local([replica]) == "tokenizer"
    asyncio.run(body())
