"""The servicer's messages (pb.GenerateStreamResponse / GenerateResponse) -> OpenAI's JSON:
completions and chat, whole or as stream chunks, with logprobs as each endpoint defines them
and usage with cached tokens."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from openai_api.reasoning_parsers import ThinkReader
from openai_api.reasoning_parsers import split as split_reasoning
from openai_api.tool_calls import ForcedCalls, call_json, new_call_id, required_calls
from openai_api.tool_parsers import parse, reader
from pagedgen_api import generation_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}
# JSON has no -inf: the floor vLLM reports for a token the model gives no chance.
MIN_LOGPROB = -9999.0


def usage_json(usages: list[pb.Usage]) -> dict:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in usages)}}


def stop_reason(c: pb.Completion) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or token id that ended the completion."""
    which = c.WhichOneof("stop_reason")
    return None if which is None else getattr(c, which)


@dataclass(slots=True)
class _ChoiceState:
    text_offset: int = 0  # characters of the completion so far (completions' text_offset)
    started: bool = False  # chat: the role chunk was sent
    echoed: bool = False  # completions with echo: the prompt's text was sent
    scored: bool = False  # completions with vLLM's prompt_logprobs: they were sent
    call_id: str | None = None  # chat with a named function forced: its call's id, once sent
    calls_text: list[str] = field(default_factory=list)  # "required": the calls' text so far
    reader: object | None = None  # "auto": reads calls from the text (tool_parsers.reader)
    thinking: ThinkReader | None = None  # with a reasoning parser: splits thinking from answer
    num_calls: int = 0  # calls sent in this choice's deltas


@dataclass(slots=True)
class Renderer:
    """Builds one HTTP request's responses; `chat` picks the endpoint's shapes."""

    request_id: str
    model: str
    chat: bool
    n: int
    logprobs: int | None  # None: no logprobs asked for
    token_texts: Callable[[list[int]], Awaitable[list[str]]]
    token_bytes: Callable[[list[int]], Awaitable[list[bytes]]] | None = None
    # Completions with echo: makes each prompt's text, which its choices' text starts with;
    # called once, when the servicer has accepted the request (its first message or reply).
    echo_texts: Callable[[], Awaitable[list[str]]] | None = None
    # Echo with logprobs: each prompt's first token id (nothing scores it; the engine's
    # prompt_logprobs start at the second), whose entry leads a choice's logprobs.
    first_prompt_ids: list[int] | None = None
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, 0 completion tokens
    # vLLM's prompt_logprobs asked: each completions choice carries its prompt's (in its first
    # chunk in a stream), a chat response its own
    prompt_logprobs: bool = False
    # Chat whose tool_choice forces calls: the completions are tool_calls (tool_calls.py).
    forced_calls: ForcedCalls | None = None
    # Chat with tool_choice "auto": the parser that reads calls out of the text (tool_parsers).
    tool_call_parser: str | None = None
    one_call: bool = False  # "auto" with parallel_tool_calls false: the first call alone
    # A reasoning model's format (reasoning_parsers.py): its thinking goes to the message's
    # reasoning_content (and vLLM's newer name, reasoning), the rest to content and tool calls.
    reasoning_parser: str | None = None
    # Where the rendered prompt left the thinking (reasoning_parsers.prompt_state).
    reasoning_prompt_end: str | None = None
    # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:ID" (a chat
    # entry's bytes are that name's), text offsets still count the text.
    tokens_as_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    _choices: dict[int, _ChoiceState] = field(default_factory=dict)
    _echo: list[str] | None = None
    # A stream's prompt logprobs by prompt index, from the messages that carry them (up to
    # the first token's), which each of the prompt's choices leads with.
    _prompt_scores: dict[int, list[pb.TokenLogprob]] = field(default_factory=dict)

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def choice_index(self, prompt_index: int, c: pb.Completion) -> int:
        return prompt_index * self.n + c.index

    # ---- whole responses ----------------------------------------------------------------------
    async def response(self, replies: list[pb.GenerateResponse]) -> dict:
        await self.prepare()
        choices = []
        for prompt_index, reply in enumerate(replies):
            scored = None
            if self.prompt_logprobs:  # the same list for each of the prompt's choices
                scored = await self._vllm_prompt_logprobs(reply.prompt_logprobs)
            for c in reply.completions:
                index = self.choice_index(prompt_index, c)
                choice: dict = {"index": index}
                if self.chat:
                    choice["message"] = self._message(c)
                    choice["logprobs"] = await self._logprobs(index, c.logprobs)
                else:
                    choice["text"] = self._echoed(prompt_index) + self._generated(c.text)
                    choice["logprobs"] = await self._logprobs(
                        index, self._generated(c.logprobs, []),
                        self._prompt_part(prompt_index, reply.prompt_logprobs))
                choice["finish_reason"], choice["stop_reason"] = self._finish(c)
                if self.chat and "tool_calls" in choice["message"]:
                    choice["finish_reason"] = self._calls_finish(choice["finish_reason"])
                if scored is not None and not self.chat:
                    choice["prompt_logprobs"] = scored
                choices.append(choice)
        response = {"id": self.request_id, "object": self.object_name,
                    "created": self.created, "model": self.model, "choices": choices,
                    "usage": self.usage([r.usage for r in replies])}
        if self.prompt_logprobs and self.chat:  # (one prompt)
            response["prompt_logprobs"] = scored
        return response

    def usage(self, usages: list[pb.Usage]) -> dict:
        """Usage as the client sees it: with echo alone (max_tokens 0), no completion tokens
        (the one the engine generated is not returned)."""
        out = usage_json(usages)
        if self.echo_only:
            out["total_tokens"] -= out["completion_tokens"]
            out["completion_tokens"] = 0
        return out

    # ---- stream chunks ------------------------------------------------------------------------
    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        return {"id": self.request_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": usage}

    def role_chunks(self, num_prompts: int) -> list[dict]:
        """Chat streams open each choice with the assistant's role (as OpenAI's do)."""
        if not self.chat:
            return []
        out = []
        for index in range(num_prompts * self.n):
            self._state(index).started = True
            # (a forced call's content is null, as the whole reply's)
            content = None if self.forced_calls is not None else ""
            out.append(self.chunk([{"index": index,
                                    "delta": {"role": "assistant", "content": content},
                                    "logprobs": None, "finish_reason": None}]))
        return out

    async def stream_choices(self, prompt_index: int, message: pb.GenerateStreamResponse
                             ) -> list[dict]:
        """The stream choices of one servicer message: one per completion that progressed."""
        await self.prepare()
        if message.prompt_logprobs:  # (a long prompt's over several messages)
            self._prompt_scores.setdefault(prompt_index, []).extend(message.prompt_logprobs)
        out = []
        for c in message.choices:
            index = self.choice_index(prompt_index, c)
            choice: dict = {"index": index}
            if self.chat:
                state = self._state(index)
                choice["delta"] = self._delta(c, state)
                if not state.started:  # (beams arrive at the end, all at once)
                    state.started = True
                    choice["delta"]["role"] = "assistant"
                choice["logprobs"] = await self._logprobs(index, c.logprobs)
            else:
                choice["text"] = self._generated(c.text)
                prompt_part = None
                if self._echo is not None:  # a choice's first chunk starts with the prompt
                    state = self._state(index)
                    if not state.echoed:
                        state.echoed = True
                        choice["text"] = self._echo[prompt_index] + choice["text"]
                        prompt_part = self._prompt_part(
                            prompt_index, self._prompt_scores.get(prompt_index, ()))
                choice["logprobs"] = await self._logprobs(
                    index, self._generated(c.logprobs, []), prompt_part)
                if self.prompt_logprobs and not self._state(index).scored:
                    self._state(index).scored = True
                    choice["prompt_logprobs"] = await self._vllm_prompt_logprobs(
                        self._prompt_scores.get(prompt_index, ()))
            choice["finish_reason"] = self._finish(c)[0]
            if c.finish_reason:
                choice["stop_reason"] = self._finish(c)[1]
                if self.chat and self._state(index).num_calls:
                    choice["finish_reason"] = self._calls_finish(choice["finish_reason"])
            if self._says_nothing(choice):
                continue
            out.append(choice)
        return out

    def _says_nothing(self, choice: dict) -> bool:
        """A chat chunk a parser left empty (the text it holds may be a tag or a call): not
        sent, as vLLM sends none; one that ends the choice or carries logprobs is."""
        if not self.chat or (self.reasoning_parser is None and self.tool_call_parser is None):
            return False
        return (choice["delta"] in ({}, {"content": ""}) and not choice["logprobs"]
                and choice["finish_reason"] is None)

    # ---- tool calls -----------------------------------------------------------------------------
    def _calls_finish(self, reason: str | None) -> str | None:
        """A choice that made calls ends with "tool_calls" (OpenAI's, for calls the model
        chose), but for a named function: "stop" (OpenAI's too)."""
        named = self.forced_calls is not None and self.forced_calls.name is not None
        return "tool_calls" if reason == "stop" and not named else reason

    def _message(self, c: pb.Completion) -> dict:
        """A whole chat response's message: its text, or the calls it makes; with a reasoning
        parser, its thinking apart (null where it had none)."""
        if self.reasoning_parser is None:
            return self._answer_message(c.text)
        reasoning, text = split_reasoning(self.reasoning_parser, c.text,
                                          self.reasoning_prompt_end)
        message = self._answer_message(text)
        if reasoning is not None and message["content"] == "":
            message["content"] = None  # all thinking (cut short): no answer, as vLLM's
        message["reasoning_content"] = message["reasoning"] = reasoning
        return message

    def _answer_message(self, text: str) -> dict:
        if self.tool_call_parser is not None:
            read = parse(self.tool_call_parser, text)
            if self.one_call:
                del read.calls[1:]
            if not read.calls:
                return {"role": "assistant", "content": read.content}
            return {"role": "assistant", "content": read.content
                    if read.content and not read.content.isspace() else None,
                    "tool_calls": read.calls}
        forced = self.forced_calls
        if forced is None:
            return {"role": "assistant", "content": text}
        if forced.name is not None:
            calls = [call_json(forced.name, text)]
        else:
            calls = required_calls(text)
            if calls is None:  # cut short (max_tokens): the text as it stands
                return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": None, "tool_calls": calls}

    def _delta(self, c: pb.Completion, state: _ChoiceState) -> dict:
        """A stream chunk's delta (_answer_delta); with a reasoning parser, the thinking in
        it apart, as reasoning_content (and reasoning)."""
        if self.reasoning_parser is None:
            return self._answer_delta(c, state, c.text)
        if state.thinking is None:
            state.thinking = ThinkReader(self.reasoning_parser, self.reasoning_prompt_end)
        read = state.thinking.feed(c.text)
        if c.finish_reason:
            last = state.thinking.finish()
            read.reasoning += last.reasoning
            read.content += last.content
        delta = self._answer_delta(c, state, read.content)
        if read.reasoning:
            if delta.get("content") == "":
                del delta["content"]
            delta["reasoning_content"] = delta["reasoning"] = read.reasoning
        return delta

    def _answer_delta(self, c: pb.Completion, state: _ChoiceState, text: str) -> dict:
        """The answer's part of a delta: the text; with a named function forced, its
        arguments as they come (the call's id and name in the first); with "required",
        nothing until the completion ends, then its calls whole (or its text, cut short)."""
        if self.tool_call_parser is not None:
            return self._read_delta(c, state, text)
        forced = self.forced_calls
        if forced is None:
            return {"content": text} if text or not c.finish_reason else {}
        if forced.name is not None:
            if not text:
                return {}
            if state.call_id is None:
                state.num_calls = 1
                state.call_id = new_call_id()
                return {"tool_calls": [{"index": 0, **call_json(forced.name, text,
                                                               state.call_id)}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        state.calls_text.append(text)
        if not c.finish_reason:
            return {}
        text = "".join(state.calls_text)
        calls = required_calls(text)
        if calls is None:
            return {"content": text} if text else {}
        state.num_calls = len(calls)
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}

    def _read_delta(self, c: pb.Completion, state: _ChoiceState, text: str) -> dict:
        """tool_choice "auto": the text as content until it may be a call, each call whole
        once its text closes (tool_parsers.py)."""
        if state.reader is None:
            state.reader = reader(self.tool_call_parser)
        read = state.reader.feed(text)
        if c.finish_reason:
            last = state.reader.finish()
            read.content += last.content
            read.calls += last.calls
        if self.one_call:
            del read.calls[max(0, 1 - state.num_calls):]
        delta: dict = {}
        if read.content:
            delta["content"] = read.content
        if read.calls:
            delta["tool_calls"] = [{"index": state.num_calls + i, **call}
                                   for i, call in enumerate(read.calls)]
            state.num_calls += len(read.calls)
        return delta

    async def prepare(self) -> None:
        """What rendering needs beyond the messages (the prompts' texts to echo), made once."""
        if self.echo_texts is not None and self._echo is None:
            self._echo = await self.echo_texts()

    def _echoed(self, prompt_index: int) -> str:
        return "" if self._echo is None else self._echo[prompt_index]

    def _generated(self, value: str | list, nothing: str | list = "") -> str | list:
        """A completion's own text or logprobs: nothing with echo alone (max_tokens 0)."""
        return nothing if self.echo_only else value

    def _finish(self, c: pb.Completion) -> tuple[str | None, str | int | None]:
        """finish_reason and stop_reason; with echo alone, "length" (max_tokens 0 reached)
        whatever ended the token the engine generated and dropped (EOS, a stop string)."""
        reason = FINISH_REASONS[c.finish_reason]
        if self.echo_only and reason in ("stop", "length"):
            return "length", None
        return reason, stop_reason(c)

    def _prompt_part(self, prompt_index: int, scored) -> tuple[int, list] | None:
        """The first prompt token's id and the others' logprobs, when a choice leads with
        them (echo with logprobs)."""
        if self.first_prompt_ids is None:
            return None
        return self.first_prompt_ids[prompt_index], list(scored)

    async def _vllm_prompt_logprobs(self, scored) -> list[dict | None]:
        """vLLM's prompt_logprobs: null for the first prompt token (nothing scores it), then
        per token {token id: {logprob, rank, decoded_token}} for its top ones and itself."""
        ids = sorted({t.token_id for lp in scored for t in lp.top} | {lp.token_id
                                                                      for lp in scored})
        texts = dict(zip(ids, await self.token_texts(ids), strict=True)) if ids else {}
        out: list[dict | None] = [None]
        for lp in scored:
            # lp.top is in rank order (the prompt token last when it is not among them)
            out.append({str(t.token_id): {
                "logprob": _finite(t.logprob),
                "rank": lp.rank if t.token_id == lp.token_id else rank,
                "decoded_token": texts[t.token_id]} for rank, t in enumerate(lp.top, 1)})
        return out

    # ---- logprobs -----------------------------------------------------------------------------
    def _state(self, index: int) -> _ChoiceState:
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _ChoiceState()
        return state

    async def _logprobs(self, index: int, logprobs, prompt: tuple[int, list] | None = None
                        ) -> dict | None:
        """prompt: (first prompt token id, the others' logprobs), which lead (echo): the first
        token has no logprob and no top (null), as OpenAI's."""
        if self.logprobs is None:
            return None
        if prompt is not None:
            logprobs = prompt[1] + list(logprobs)
        ids = sorted({lp.token_id for lp in logprobs} | {t.token_id for lp in logprobs
                                                          for t in lp.top}
                     | ({prompt[0]} if prompt is not None else set()))
        if self.tokens_as_ids and self.chat:
            names = {t: f"token_id:{t}" for t in ids}
            raw = {t: name.encode() for t, name in names.items()}
            return {"content": [self._chat_token(lp, names, raw) for lp in logprobs]}
        texts = dict(zip(ids, await self.token_texts(ids), strict=True)) if ids else {}
        if self.chat:
            if self.token_bytes is not None and ids:
                raw = dict(zip(ids, await self.token_bytes(ids), strict=True))
            else:  # a partial character's bytes are lost with its text (U+FFFD)
                raw = {t: text.encode() for t, text in texts.items()}
            return {"content": [self._chat_token(lp, texts, raw) for lp in logprobs]}
        names = {t: f"token_id:{t}" for t in ids} if self.tokens_as_ids else texts
        state = self._state(index)
        tokens, token_logprobs, tops, offsets = [], [], [], []
        if prompt is not None:
            text = texts[prompt[0]]
            tokens.append(names[prompt[0]])
            token_logprobs.append(None)
            tops.append(None)
            offsets.append(state.text_offset)
            state.text_offset += len(text)
        for lp in logprobs:
            text = texts[lp.token_id]
            tokens.append(names[lp.token_id])
            token_logprobs.append(_finite(lp.logprob))
            top = {names[t.token_id]: _finite(t.logprob) for t in lp.top}
            # the sampled token, as OpenAI's has
            top.setdefault(names[lp.token_id], _finite(lp.logprob))
            tops.append(top)
            offsets.append(state.text_offset)
            state.text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def _chat_token(self, lp: pb.TokenLogprob, texts: dict[int, str], raw: dict[int, bytes]
                    ) -> dict:
        best = sorted(lp.top, key=lambda t: t.logprob, reverse=True)[:self.logprobs]
        entry = _chat_entry(texts[lp.token_id], raw[lp.token_id], lp.logprob)
        entry["top_logprobs"] = [_chat_entry(texts[t.token_id], raw[t.token_id], t.logprob)
                                 for t in best]
        return entry


def _chat_entry(text: str, raw: bytes, logprob: float) -> dict:
    """OpenAI's: `bytes` the token's own UTF-8 bytes, which joined rebuild the text even where
    one token holds part of a character (its `token` text is then U+FFFD)."""
    return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}


def _finite(logprob: float) -> float:
    """-inf (a token the sampler ruled out) and NaN are not JSON: both become MIN_LOGPROB."""
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB
