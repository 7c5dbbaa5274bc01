"""The text of a stream resumed on another replica, continuous with what the client already got.

An engine holds back the tail of its output text that could be the start of a stop string (and
a UTF-8 character split across tokens). A replica that dies takes that text with it, and the
next one, given the tokens already streamed as part of its prompt, never sends it. So from the
first switch of replica on, the router writes the text itself:

- With its local tokenizer (router/prompt.py, checked against the replicas): the engines' own
  incremental detokenizer, caught up on the original prompt and every token streamed, is fed
  each token the new replica sends, and its deltas replace the replica's text. The text is then
  exactly an uninterrupted run's, and a stop string that began before the switch is caught when
  it completes after it (the router ends the stream there, as the engine would have).
- Without one: at each switch the replicas' Detokenize gives the text of the tokens streamed, and
  what the client has not got of it goes out with the next message. Stop strings then only match
  in the text generated after the switch, and a character split across the switch is lost.
"""

from __future__ import annotations

import logging

import grpc

from engine_service.model.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from pagedgen_api import generation_pb2 as pb
from router.prompt import PromptReader
from router.replicas import Replica

log = logging.getLogger("router.resumed_text")
_REPLACEMENT = "\ufffd"


class ResumedText:
    def __init__(self, prompts: PromptReader, sampling: pb.SamplingParams,
                 prompt_ids: list[int], rpc_timeout_s: float) -> None:
        self.prompts = prompts
        self.sampling = sampling
        self.prompt_ids = prompt_ids  # the original prompt (not the resumed one)
        self.rpc_timeout_s = rpc_timeout_s
        self.skip_special_tokens = (sampling.skip_special_tokens
                                    if sampling.HasField("skip_special_tokens") else True)
        self.detokenizer: IncrementalDetokenizer | None = None  # set: the router writes the text
        self.pending = ""  # without one: text owed to the client, sent with the next message

    async def switch(self, replicas: list[Replica], token_ids: list[int], sent: str) -> None:
        """At a switch of replica: `token_ids` were streamed so far, `sent` is their text as
        the client got it."""
        if self.detokenizer is not None:
            return  # it has followed every token since an earlier switch
        tokenizer = self.prompts.local(replicas)
        if tokenizer is not None:
            detokenizer = await self.prompts.run(self._caught_up, tokenizer, token_ids)
            if detokenizer.text == sent:
                self.detokenizer = detokenizer
                return
            log.warning("the router's detokenizer disagrees with the text streamed before the "
                        "switch (%d vs %d characters): asking a replica instead",
                        len(detokenizer.text), len(sent))
        self.pending = await self._owed(replicas, token_ids, sent)

    def _caught_up(self, tokenizer, token_ids: list[int]) -> IncrementalDetokenizer:
        sampling = self.sampling
        detokenizer = IncrementalDetokenizer(
            tokenizer, self.prompt_ids, list(sampling.stop), sampling.include_stop_str_in_output,
            self.skip_special_tokens, min_tokens=sampling.min_tokens)
        for token in token_ids:
            detokenizer.add_token(token)
        return detokenizer

    async def _owed(self, replicas: list[Replica], token_ids: list[int], sent: str) -> str:
        """The text of `token_ids` beyond `sent`, decoded by a replica as its detokenizer
        would (after the prompt's last tokens, for the first piece's leading space)."""
        context = self.prompt_ids[-PROMPT_CONTEXT_TOKENS:]
        for replica in replicas[:2]:
            try:
                texts = [(await replica.stub.Detokenize(
                    pb.DetokenizeRequest(token_ids=ids,
                                         skip_special_tokens=self.skip_special_tokens),
                    timeout=self.rpc_timeout_s)).text for ids in (context, context + token_ids)]
            except grpc.aio.AioRpcError:
                continue
            # An incomplete character at the end is not text yet (and the next replica cannot
            # complete it: it is lost).
            text = texts[1][len(texts[0]):].rstrip(_REPLACEMENT)
            if text.startswith(sent):
                return text[len(sent):]
            log.warning("a replica's Detokenize disagrees with the text streamed before the "
                        "switch: the text held back then is not sent")
            return ""
        log.warning("no replica could Detokenize the tokens streamed before the switch: the "
                    "text held back then is not sent")
        return ""

    async def rewrite(self, choice: pb.Completion) -> int | None:
        """Sets the text of a delta the new replica sent; returns how many of its tokens to keep
        when a stop string that began before the switch completes in it (the stream ends)."""
        if self.detokenizer is None:
            choice.text, self.pending = self.pending + choice.text, ""
            return None
        text, kept = await self.prompts.run(self._follow, list(choice.token_ids),
                                            bool(choice.finish_reason))
        choice.text = text
        return kept

    def _follow(self, token_ids: list[int], last: bool) -> tuple[str, int | None]:
        detokenizer = self.detokenizer
        text = []
        for i, token in enumerate(token_ids):
            text.append(detokenizer.add_token(token))
            if detokenizer.matched_stop is not None:
                return "".join(text), i + 1
        if last:  # the replica ended it (length, EOS, a stop token, abort): nothing is held
            text.append(detokenizer.finish())
        return "".join(text), None

    async def flush(self) -> str:
        """The text still owed when the stream ends at the switch (nothing left to generate)."""
        if self.detokenizer is None:
            text, self.pending = self.pending, ""
            return text
        return await self.prompts.run(self.detokenizer.finish)

    @property
    def matched_stop(self) -> str | None:
        return self.detokenizer.matched_stop if self.detokenizer is not None else None
