"""A request's prompt token ids, as the engines will see them, so the router can hash them.

The router tokenizes with the engines' own tokenizer when it can load it (the model directory
the replicas report, or --tokenizer) and it agrees with a replica on a probe; otherwise it asks
a replica (Tokenize). Token-id input needs neither. Nothing here rejects a request: a prompt the
router cannot read is routed without prefix credit, and the engine gives the error.

The local tokenizer runs on one worker thread, never on the event loop: a long prompt (or one
far over the engines' limit, which is not read at all) would freeze every stream meanwhile, and
an HF fast tokenizer must not be used from two threads at once.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from engine_service.model.config import load_model_config
from engine_service.model.tokenizer import encode_text, load_tokenizer
from engine_service.serving.chat_input import chat_chars, chat_token_ids
from engine_service.serving.validation import CHARS_PER_CONTEXT_TOKEN
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
        self.identity = ""  # the model identity of the replica the local tokenizer agreed with
        self._checked_for = ""  # the model identity the last load was for
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="router-tokenizer")

    def prepare(self, replica: Replica) -> None:
        """Starts loading a local tokenizer (once), checked against `replica`."""
        if replica.info is None:
            return
        if self._loading is not None and self._loading.done() and (
                self._checked_for != replica.info.model_identity):
            # The replicas serve another model now: its tokenizer may differ.
            log.info("replicas now serve %s: checking the local tokenizer again",
                     replica.info.model_identity)
            self.tokenizer, self.source, self.identity = None, "replica", ""
            self._loading = None
        if self._loading is None:
            self._loading = asyncio.ensure_future(self._load(replica))

    async def _load(self, replica: Replica) -> None:
        # Read before the awaits: discovery may reset replica.info meanwhile (another engine
        # at the address), and the tokenizer checked is for this identity.
        identity = self._checked_for = replica.info.model_identity
        path = self.tokenizer_path or replica.info.model_path
        if not path or not Path(path).exists():
            log.info("no local tokenizer (%s is not on this machine): prompts are tokenized by "
                     "a replica", path or "no path")
            return
        try:
            loop = asyncio.get_running_loop()
            tokenizer = await loop.run_in_executor(
                self._worker, lambda: load_tokenizer(load_model_config(path)))
            local = await loop.run_in_executor(self._worker, chat_token_ids, tokenizer, _PROBE)
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
        self.identity = identity
        log.info("tokenizing prompts locally with %s", path)

    async def token_ids(self, request, replicas: list[Replica]) -> list[int] | None:
        """`request`: a GenerateRequest or PinPrefixRequest (oneof `input`)."""
        which = request.WhichOneof("input")
        if which == "token_ids":
            return list(request.token_ids.ids)
        if which is None:
            return None
        if self.local(replicas) is not None:
            size = (len(request.text) if which == "text"
                    else chat_chars(request.chat))
            if size > _max_prompt_chars(replicas) or (which == "text" and not request.text):
                return None  # every engine refuses it (too long, or empty): not read here
            loop = asyncio.get_running_loop()
            try:
                if which == "text":
                    return await loop.run_in_executor(self._worker, encode_text,
                                                      self.tokenizer, request.text)
                return await loop.run_in_executor(self._worker, chat_token_ids, self.tokenizer,
                                                  request.chat)
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

    def local(self, replicas: list[Replica]):
        """The local tokenizer when it agrees with the model `replicas` serve now, else None."""
        if self.tokenizer is not None and replicas and replicas[0].info is not None and (
                replicas[0].info.model_identity == self.identity):
            return self.tokenizer
        return None

    async def run(self, work, *args):
        """`work(*args)` on the tokenizer's thread (the only one that may use it)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, work, *args)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def _max_prompt_chars(replicas: list[Replica]) -> int:
    """The most prompt characters any of `replicas` accepts (the engines' own limit); no limit
    while none has said its context length."""
    lengths = [r.info.max_model_len for r in replicas if r.info is not None]
    return CHARS_PER_CONTEXT_TOKEN * max(lengths) if lengths else 1 << 62



