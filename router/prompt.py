"""A request's prompt token ids, as the engines will see them, so the router can hash them.

The router tokenizes with the engines' own tokenizer when it can load it (the model directory
the replicas report, or --tokenizer) and it agrees with a replica on a probe; otherwise it asks
a replica (Tokenize). Token-id input needs neither. Nothing here rejects a request: a prompt the
router cannot read is routed without prefix credit, and the engine gives the error.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc

from engine_service.model.config import load_model_config
from engine_service.model.tokenizer import (
    encode_rendered_chat,
    encode_text,
    load_tokenizer,
    render_chat,
)
from pagedgen_api import generation_pb2 as pb
from router.replicas import Replica

log = logging.getLogger("router.prompt")
_PROBE = pb.ChatMessages(messages=[
    pb.ChatMessage(role="system", content="You are a helpful assistant."),
    pb.ChatMessage(role="user", content="Tokenize me: naïve café, 12345 — done."),
])


class PromptReader:
    def __init__(self, tokenizer_path: str | None, rpc_timeout_s: float) -> None:
        self.tokenizer_path = tokenizer_path
        self.rpc_timeout_s = rpc_timeout_s
        self.tokenizer = None
        self._loading: asyncio.Task | None = None
        self.source = "replica"  # "local" once a local tokenizer is checked and in use

    def prepare(self, replica: Replica) -> None:
        """Starts loading a local tokenizer (once), checked against `replica`."""
        if self._loading is None and replica.info is not None:
            self._loading = asyncio.ensure_future(self._load(replica))

    async def _load(self, replica: Replica) -> None:
        path = self.tokenizer_path or replica.info.model_path
        if not path or not Path(path).exists():
            log.info("no local tokenizer (%s is not on this machine): prompts are tokenized by "
                     "a replica", path or "no path")
            return
        try:
            tokenizer = await asyncio.to_thread(lambda: load_tokenizer(load_model_config(path)))
            local = _chat_ids(tokenizer, _PROBE)
            remote = await replica.stub.Tokenize(pb.TokenizeRequest(chat=_PROBE),
                                                 timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as error:
            # The replica could not answer the probe now: try again on a later poll.
            log.info("local tokenizer from %s not checked yet: %s", path, error.code().name)
            self._loading = None
            return
        except (ValueError, OSError) as error:
            log.warning("local tokenizer from %s not used: %s", path, error)
            return
        if local != list(remote.token_ids):
            log.warning("local tokenizer from %s disagrees with replica %s: not used", path,
                        replica.name)
            return
        self.tokenizer = tokenizer
        self.source = "local"
        log.info("tokenizing prompts locally with %s", path)

    async def token_ids(self, request, replicas: list[Replica]) -> list[int] | None:
        """`request`: a GenerateRequest or PinPrefixRequest (oneof `input`)."""
        which = request.WhichOneof("input")
        if which == "token_ids":
            return list(request.token_ids.ids)
        if which is None:
            return None
        if self.tokenizer is not None:
            try:
                if which == "text":
                    return encode_text(self.tokenizer, request.text) if request.text else None
                return _chat_ids(self.tokenizer, request.chat)
            except Exception as error:  # noqa: BLE001 - templates raise whatever they like
                log.debug("could not tokenize locally: %s", error)
                return None
        for replica in replicas[:2]:
            ask = (pb.TokenizeRequest(text=request.text) if which == "text"
                   else pb.TokenizeRequest(chat=request.chat))
            try:
                reply = await replica.stub.Tokenize(ask, timeout=self.rpc_timeout_s)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    continue
                return None  # bad input: the engine will say so when it gets the request
            return list(reply.token_ids)
        return None


def _chat_ids(tokenizer, chat: pb.ChatMessages) -> list[int]:
    conversation = [{"role": m.role, "content": m.content} for m in chat.messages]
    return encode_rendered_chat(tokenizer, render_chat(tokenizer, conversation))
