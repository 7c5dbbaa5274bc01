"""The Generation gRPC servicer: validates, submits to the async engine, streams outputs back.

Every way a request can end early (client cancellation, deadline, Abort, server drain) aborts it
in the engine, which frees its KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import PurePath
from typing import Protocol

import grpc

from engine_service.core.errors import EngineDeadError, QueueFullError, RequestError
from engine_service.core.outputs import CompletionOutput, RequestOutput
from engine_service.core.stats import EngineStats
from engine_service.index.link import IndexUnavailableError, PinRefusedError
from engine_service.model.sampling_params import MAX_LOGPROBS, MAX_N
from engine_service.model.token_logprobs import TokenLogprobs
from engine_service.serving.async_engine import AsyncEngine
from engine_service.serving.chat_input import chat_chars
from engine_service.serving.core_client import CoreClient
from engine_service.serving.metrics import EngineMetrics
from engine_service.serving.named_locks import NamedLocks
from engine_service.serving.prefix_pins import PrefixPinner
from engine_service.serving.send_stall import (
    DEFAULT_SEND_STALL_TIMEOUT_S,
    SendStallWatch,
    StreamSend,
)
from engine_service.serving.status import RequestRejected, cancel_code, status_for
from engine_service.serving.text_worker import TextWorker
from engine_service.serving.validation import Prompt, RequestValidator, ValidRequest
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tenancy.door import TenantDoor, TenantRefused
from tenancy.gate import Caller, Unauthenticated
from tenancy.request_ids import scoped_request_id

log = logging.getLogger(__name__)
# A stream message carries at most this many prompt logprob entries (a token and each of its
# top ones): about 1 MiB on the wire (16-byte TopLogprobs).
PROMPT_LOGPROB_ENTRIES_PER_MESSAGE = 65_536
# A generation's text or chat input longer than this (in characters) is tokenized on the text
# worker, not on the event loop: a 131,000-character prompt held the loop ~0.1 s, and every
# other stream with it (a flood of them: 0.3 s gaps in another client's stream), and a
# 128K-token context takes prompts 32 times as long. Shorter ones cost the loop under ~3 ms.
INLINE_TOKENIZE_CHARS = 8192



@dataclass(slots=True)
class CallTally:
    """A generation call's count in requests_total, made once: as its status is decided where
    the servicer ends it (grpc.aio's abort sends the status before it raises, so counted as
    the handler unwinds, a client could hold its refusal before a scrape saw it), else as the
    call ends."""

    counted: bool = False


FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


class DeadlinePassed(Exception):
    """Put in a request's outputs when its gRPC deadline passes."""


class IndexLink(Protocol):
    """What the servicer needs from the prefix index link (engine_service/index/policy.py)."""

    @property
    def degraded(self) -> bool: ...

    def health_details(self) -> dict[str, str]: ...

    async def pin_prefix(self, chain: list[bytes], ttl_s: float, unpin: bool) -> int:
        """Pins (or unpins) the held prefix of `chain`; how many blocks it changed."""


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(
        self,
        engine: AsyncEngine | CoreClient,
        validator: RequestValidator,
        metrics: EngineMetrics,
        engine_id: str,
        index_link: IndexLink | None = None,
        door: TenantDoor | None = None,
        text_worker: TextWorker | None = None,
        send_stall_timeout_s: float = DEFAULT_SEND_STALL_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.validator = validator
        self.text_worker = text_worker  # Tokenize / Detokenize off the loop (None: on it)
        self.metrics = metrics
        self.engine_id = engine_id
        # This process's own id (ModelInfo): a router tells a restart from an outage by it.
        self.instance_id = secrets.token_hex(8)
        self.index_link = index_link
        self.pinner = PrefixPinner(engine, index_link)  # PinPrefix: computes, then pins
        self._pin_calls = NamedLocks()  # PinPrefix calls in progress, by pin name
        self.door = door or TenantDoor()  # who calls; tenants' salts and limits (tenancy/)
        # Live request id -> the tenant that started it: only that tenant may Abort it.
        self.owners: dict[str, str | None] = {}
        # Generation calls from their admission until their last message is sent. A request
        # the engine finished still holds its output here until its client reads it: the queue
        # limit counts these calls (num_live), not only the engine's live requests, or a
        # client that never read its streams piled up finished outputs without bound (3.5 MB a
        # stream of 1,000 tokens with 20 logprobs, the engine's live count back at 0).
        self.num_open_calls = 0
        self.num_tokenizing = 0  # generations whose long prompt is on the text worker
        self.num_pinning = 0  # PinPrefix prefills running in the engine (no generation call)
        self.draining = False
        self.send_stalls = SendStallWatch(send_stall_timeout_s, "this engine's",
                                          metrics.send_stalls.inc)

    @property
    def num_live(self) -> int:
        """Requests the queue limit counts: live in the engine, or not yet sent in full, or
        with their prompt being tokenized. (The engine's count, for a request it has not
        dropped yet after its call ended.)"""
        calls = self.num_open_calls + self.num_pinning
        return max(self.engine.num_live, calls) + self.num_tokenizing

    def _check_queue_room(self) -> None:
        limit = self.validator.max_live_requests
        if self.num_live >= limit:
            raise QueueFullError("request", f"live requests must be at most {limit} (the queue "
                                            f"limit), got {self.num_live + 1}: retry later")

    # ---- generation -------------------------------------------------------------------------
    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        # How the call ended, counted once (requests_total), and its writes as the stall watch
        # sees them: here, not around it: a wrapping generator would cost every message a hop.
        code = "OK"
        timeout_s = context.time_remaining()
        send: StreamSend | None = None
        tally = CallTally()
        try:
            valid, caller = await self._admit(request, context, tally)
            finished_indices: set[int] = set()
            send = self.send_stalls.open(context)
            async with contextlib.aclosing(self._run(valid, caller, context, tally)) as outputs:
                async for output in outputs:
                    choices = []
                    for c in output.outputs:
                        # A finish reason is sent once, with the completion's last delta.
                        newly_finished = _newly_finished(c, finished_indices)
                        if c.token_ids_delta or c.text_delta or newly_finished:
                            choices.append(_completion(c, delta=True))
                    for message in _stream_messages(valid.request_id, output, choices):
                        if not send.headers_sent:
                            await self.send_stalls.send_headers(send)
                        send.since = time.monotonic()
                        yield message
                        send.since = None  # written: the transport took it
        except BaseException as error:
            # (the mark, not the call's code: a stream stalled in sending its headers ends
            # before its status is set (_end), and one over HTTP has no status)
            stalled = send is not None and send.stalled
            code = "DEADLINE_EXCEEDED" if stalled else _ended_with(error, context, timeout_s)
            raise
        finally:
            if send is not None:
                self.send_stalls.close(send)
            if not tally.counted:
                self.metrics.requests.labels(code).inc()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        code = "OK"
        timeout_s = context.time_remaining()
        tally = CallTally()
        try:
            valid, caller = await self._admit(request, context, tally)
            last = None
            prompt_logprobs = []  # in one output: the first token's (or the final one)
            async with contextlib.aclosing(self._run(valid, caller, context, tally)) as outputs:
                async for output in outputs:
                    last = output
                    prompt_logprobs = prompt_logprobs or _prompt_logprobs(output)
            assert last is not None and last.finished
            return pb.GenerateResponse(
                request_id=valid.request_id,
                completions=[_completion(c, delta=False) for c in last.outputs],
                usage=_usage(last),
                prompt_logprobs=prompt_logprobs,
            )
        except BaseException as error:
            code = _ended_with(error, context, timeout_s)
            raise
        finally:
            if not tally.counted:
                self.metrics.requests.labels(code).inc()

    async def _admit(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, tally: CallTally
    ) -> tuple[ValidRequest, Caller]:
        try:
            caller = self.door.gate.caller(context)
        except Unauthenticated as error:
            await self._refuse(context, tally, grpc.StatusCode.UNAUTHENTICATED, str(error))
        if self.draining:
            await self._refuse(context, tally, grpc.StatusCode.UNAVAILABLE,
                               "the engine is draining (shutting down): retry on another one")
        try:
            self.door.check_priority(caller, request.priority)
            prompt = None
            if self.text_worker is not None and _input_chars(request) > INLINE_TOKENIZE_CHARS:
                # Counted from now, in the queue and among its tenant's live requests: the
                # wait holds the request (a tenant allowed one took every queue slot with
                # long prompts while they waited here).
                self._check_queue_room()
                self.door.enter(caller)
                self.num_tokenizing += 1
                try:
                    prompt = await self.text_worker.run(_tokenize, request, bounded=False)
                finally:
                    self.num_tokenizing -= 1
                    self.door.leave(caller)  # _run enters again, with no await between
            # Live ids are the tenant's own: another tenant's live id is free here. (No await
            # from here to the engine's add: the id and the queue limit hold until then.)
            valid = self.validator.generate(
                request, lambda rid: self.engine.is_live(scoped_request_id(caller.tenant, rid)),
                self.num_live, prompt)
        except (RequestRejected, RequestError) as error:
            await self._refuse(context, tally, *status_for(error))
        except TenantRefused as error:
            await self._refuse(context, tally, error.code, error.message)
        # The tenant's salt, not the client's alone: tenants never share blocks (tenancy/).
        valid.cache_salt = self.door.cache_salt(caller, valid.cache_salt or "") or None
        return valid, caller

    async def _require_live_engine(self, context) -> None:
        try:
            self.engine.check_alive()
        except EngineDeadError as error:
            await context.abort(*status_for(error))

    async def _refuse(self, context, tally: CallTally, code: grpc.StatusCode, message: str
                      ) -> None:
        """A generation call refused before it ran (raises)."""
        self.metrics.requests_rejected.labels(code.name).inc()
        await self._end(context, tally, code, message)

    async def _end(self, context, tally: CallTally, code: grpc.StatusCode, message: str
                   ) -> None:
        """A generation call ended with `code` (raises): counted first (CallTally)."""
        tally.counted = True
        self.metrics.requests.labels(code.name).inc()
        await context.abort(code, message)

    async def _run(
        self, valid: ValidRequest, caller: Caller, context: grpc.aio.ServicerContext,
        tally: CallTally,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs until the last; aborts it in the engine on any early exit."""
        try:
            self.door.enter(caller)  # (its tenant's live requests: counted until it ends)
        except TenantRefused as error:
            await self._refuse(context, tally, error.code, error.message)
        # The id it runs under in the engine: another tenant may use the same one at once.
        engine_request_id = scoped_request_id(caller.tenant, valid.request_id)
        self.owners[engine_request_id] = caller.tenant
        self.num_open_calls += 1
        try:
            arrival = time.monotonic()
            remaining = context.time_remaining()
            deadline = None if remaining is None else arrival + remaining
            try:
                outputs = self.engine.add(
                    engine_request_id,
                    valid.prompt.token_ids,
                    valid.params,
                    prompt=valid.prompt.text,
                    cache_salt=valid.cache_salt,
                    priority=valid.priority,
                )
            except EngineDeadError as error:
                await self._end(context, tally, *status_for(error))
            self.metrics.prompt_tokens.inc(len(valid.prompt.token_ids))
            finished = False
            first_token_at = None
            num_tokens = 0
            # One timer for the request's deadline, which puts a marker in its outputs: a
            # wait_for around every output cost a task and a timer per streamed message.
            timer = None
            if deadline is not None:
                timer = asyncio.get_running_loop().call_later(
                    max(0.0, deadline - time.monotonic()), outputs.put_nowait, DeadlinePassed())
            try:
                while not finished:
                    item = await outputs.get()
                    if isinstance(item, DeadlinePassed):
                        self.engine.abort(engine_request_id)
                        finished = True  # the abort above is enough; do not send a second one
                        self.metrics.requests_finished.labels("abort").inc()
                        await self._end(
                            context, tally, grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"deadline exceeded after {time.monotonic() - arrival:.3f}s and "
                            f"{num_tokens} generated tokens; the request was aborted",
                        )
                    if isinstance(item, BaseException):
                        # Stopped in the engine already (an unread stream's overflow, a
                        # failed step): no second abort, but counted as one.
                        finished = True
                        self.metrics.requests_finished.labels("abort").inc()
                        await self._end(context, tally, *status_for(item))
                    finished = item.finished
                    new_tokens = sum(len(c.token_ids_delta) for c in item.outputs)
                    if new_tokens and first_token_at is None:
                        first_token_at = time.monotonic()
                        self.metrics.time_to_first_token.observe(first_token_at - arrival)
                    num_tokens += new_tokens
                    self.metrics.generation_tokens.inc(new_tokens)
                    if finished:
                        # Beams arrive all at once, at the end: no time per output token to observe.
                        first = None if valid.params.use_beam_search else first_token_at
                        self._observe_finished(item, arrival, first, num_tokens)
                    yield item
            finally:
                if timer is not None:
                    timer.cancel()
                if not finished:
                    # Cancelled by the client, or the server is stopping: free the blocks now.
                    self.engine.abort(engine_request_id)
                    self.metrics.requests_finished.labels("abort").inc()
        finally:
            self.num_open_calls -= 1
            self.owners.pop(engine_request_id, None)
            self.door.leave(caller)

    def _observe_finished(
        self, output: RequestOutput, arrival: float, first_token_at: float | None,
        num_tokens: int,
    ) -> None:
        now = time.monotonic()
        self.metrics.e2e_request_latency.observe(now - arrival)
        if first_token_at is not None and num_tokens > len(output.outputs):
            per_seq = num_tokens / len(output.outputs)
            self.metrics.time_per_output_token.observe((now - first_token_at) / (per_seq - 1))
        for completion in output.outputs:
            self.metrics.requests_finished.labels(completion.finish_reason or "abort").inc()

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        caller = await self.door.caller(context)
        # Only the caller's own ids: another tenant's live id is not among them (unknown).
        engine_request_id = scoped_request_id(caller.tenant, request.request_id)
        owner = self.owners.get(engine_request_id, caller.tenant)
        if owner != caller.tenant:  # (cannot differ: kept as a guard)
            return pb.AbortResponse(found=False)
        return pb.AbortResponse(found=self.engine.abort(engine_request_id))

    # ---- tokenizer --------------------------------------------------------------------------
    # Both on the text worker's thread (text_worker.py): their size is the client's to choose
    # (up to a context's worth), and the loop serves every other stream meanwhile.
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            prompt = await self._text_work(_tokenize, request)
        except RequestRejected as error:
            await context.abort(*status_for(error))
        return pb.TokenizeResponse(token_ids=prompt.token_ids, prompt=prompt.text or "")

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        try:
            self.validator.need_tokenizer("Detokenize")
            # Counted here, at once: a million ids are refused before the worker reads them.
            ids = self.validator.detokenize_ids(request.token_ids)
        except RequestRejected as error:
            await context.abort(*status_for(error))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        try:
            text = await self._text_work(_detokenize, ids, skip)
        except RequestRejected as error:
            await context.abort(*status_for(error))
        return pb.DetokenizeResponse(text=text)

    async def _text_work(self, work, *args):
        if self.text_worker is None:  # (no worker: on the loop, with the loop's tokenizer)
            return work(self.validator, *args)
        return await self.text_worker.run(work, *args)

    # ---- introspection ----------------------------------------------------------------------
    async def ModelInfo(self, request: pb.ModelInfoRequest, context) -> pb.ModelInfoResponse:
        caller = await self.door.caller(context)
        info = self.engine.info
        mc, limits = info.model_config, info.limits
        # This server's directory and identity are the operator's to see (tenants: the
        # directory's name, no engine or process id).
        internals = self.door.shows_internals(caller)
        return pb.ModelInfoResponse(
            model_path=str(mc.path) if internals else PurePath(mc.path).name,
            model_identity=info.model_identity,  # what seeds the block-hash chain
            architecture=mc.architecture,
            vocab_size=mc.vocab_size,
            max_model_len=limits.max_model_len,
            eos_token_ids=info.eos_token_ids,
            block_size=limits.block_size,
            num_blocks=limits.num_blocks,
            dtype=info.dtype,
            device=info.device,
            max_n=MAX_N,
            max_logprobs=MAX_LOGPROBS,
            engine_id=self.engine_id if internals else "",
            max_beam_width=limits.max_beam_width,
            instance_id=self.instance_id if internals else "",
            served_model_name=info.served_model_name,
            tensor_parallel_size=info.tensor_parallel_size,
        )

    async def EngineStats(self, request: pb.EngineStatsRequest, context) -> pb.EngineStatsResponse:
        caller = await self.door.caller(context)
        try:  # counters every tenant's traffic moves: the operator's (may_read_stats)
            self.door.check_stats(caller, "EngineStats")
        except TenantRefused as error:
            await context.abort(error.code, error.message)
        await self._require_live_engine(context)
        stats: EngineStats = self.engine.snapshot  # published by the engine each step
        link = self.index_link
        queries = stats.prefix_cache_queries
        return pb.EngineStatsResponse(
            num_blocks=stats.num_blocks,
            num_free_blocks=stats.num_free_blocks,
            num_cached_blocks=stats.num_cached_blocks,
            kv_cache_usage=stats.kv_cache_usage,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_waiting_prefill_tokens=stats.num_waiting_prefill_tokens,
            pin_budget_blocks=stats.pin_budget_blocks,
            num_pinned_blocks=stats.num_pinned_in_budget,
            num_swapped=stats.num_swapped,
            prefix_cache_queries=queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            prefix_cache_hit_rate=stats.prefix_cache_hits / queries if queries else 0.0,
            num_preemptions=stats.num_preemptions,
            num_steps=stats.num_steps,
            num_live_requests=self.engine.num_live,
            degraded=bool(link is not None and link.degraded),
            draining=self.draining,
            index_details=link.health_details() if link is not None else {"index": "none"},
        )

    async def PinPrefix(self, request: pb.PinPrefixRequest, context) -> pb.PinPrefixResponse:
        caller = await self.door.caller(context)
        await self._require_live_engine(context)
        if self.draining:  # its blocks go with it: pin where the requests will go instead
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the engine is draining (shutting down): retry on another one")
        try:
            prompt = self.validator.prompt(request, "input")
            salt = self.validator.cache_salt(request.cache_salt)
            ttl_s = self.validator.ttl_s(request.ttl_s)
        except RequestRejected as error:
            await context.abort(*status_for(error))
        info = self.engine.info
        salt = self.door.cache_salt(caller, salt or "") or None  # as its requests get it
        chain = info.hasher.chain(prompt.token_ids, salt)
        if not chain:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt must hold at least one full block ({info.limits.block_size} tokens) "
                f"to pin, got {len(prompt.token_ids)} tokens",
            )
        reservation = None
        # One PinPrefix of a prefix at a time on this engine: a pin is named by its chain's
        # last hash, so the undo of a call that fails after its prefill (an unpin of that
        # name) would also drop the pin a second call of the same prefix made meanwhile (a
        # client retrying after its deadline, say).
        async with self._pin_calls.hold(chain[-1]):
            try:
                if request.unpin:
                    changed = await self.pinner.pin(chain, ttl_s, unpin=True)
                    self.door.record_unpin(caller, chain)
                else:
                    # Counted against the tenant's pins now (a call beside this one sees it),
                    # given back below unless the pin is made.
                    reservation = self.door.reserve_pin(caller, chain, ttl_s)
                    # What is cached is pinned at once (no engine step needed: a slow step does
                    # not hold it up); the rest is computed first, then pinned with it.
                    changed = await self.pinner.pin(chain, ttl_s, unpin=False)
                    if changed < len(chain):
                        try:
                            await self.pinner.check_room(chain)  # refused now costs no prefill
                            await self._compute_prefix(caller, prompt.token_ids, salt)
                            changed = await self.pinner.pin(chain, ttl_s, unpin=False)
                        except BaseException:
                            if changed:  # no part of a refused pin stays
                                await asyncio.shield(self.pinner.pin(chain, 0.0, unpin=True))
                            raise
                    reservation = None  # kept
            except TenantRefused as error:
                await context.abort(error.code, error.message)
            except (PinRefusedError, IndexUnavailableError, RequestError, EngineDeadError) as error:
                await context.abort(*status_for(error))
            except (ConnectionError, TimeoutError, grpc.RpcError) as error:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"the prefix index did not answer: {error}"
                )
            finally:
                if reservation is not None:
                    self.door.cancel_pin(reservation)
        return pb.PinPrefixResponse(num_blocks=len(chain), num_pinned=changed)

    async def _compute_prefix(self, caller: Caller, token_ids: list[int],
                              salt: str | None) -> None:
        """The pin's prefill, admitted as a request is: within the queue limit and the
        tenant's live requests, and counted in the prompt-token metric."""
        self._check_queue_room()
        self.door.enter(caller)
        try:
            self.metrics.prompt_tokens.inc(len(token_ids))
            self.num_pinning += 1
            try:
                await self.pinner.compute(token_ids, salt)
            finally:
                self.num_pinning -= 1
        finally:
            self.door.leave(caller)


def _tokenize(validator: RequestValidator,
              request: pb.TokenizeRequest | pb.GenerateRequest) -> Prompt:
    return validator.prompt(request, "input")


def _ended_with(error: BaseException, context, timeout_s: float | None) -> str:
    """The code a generation call that raised ended with: the status it was aborted with (a
    gRPC or an HTTP call's context says it), else CANCELLED when the client went away (the
    call cancelled, or its consumer closed it; DEADLINE_EXCEEDED if its deadline, `timeout_s`
    when it arrived, ended it), else UNKNOWN (a bug's exception)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return cancel_code(context.time_remaining(), timeout_s).name
    return grpc.StatusCode.UNKNOWN.name


def _input_chars(request: pb.GenerateRequest) -> int:
    """The characters a request's input gives the tokenizer (0 for token ids)."""
    which = request.WhichOneof("input")
    if which == "text":
        return len(request.text)
    if which == "chat":
        return chat_chars(request.chat)
    return 0


def _detokenize(validator: RequestValidator, ids: list[int], skip_special_tokens: bool) -> str:
    return validator.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _newly_finished(completion: CompletionOutput, finished_indices: set[int]) -> bool:
    if completion.finish_reason is None or completion.index in finished_indices:
        return False
    finished_indices.add(completion.index)
    return True


def _token_logprob(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()],
    )


def _stream_messages(request_id: str, output: RequestOutput, choices: list[pb.Completion]
                     ) -> tuple[pb.GenerateStreamResponse, ...]:
    """An output's stream message; with prompt logprobs, as many as keep each message under
    about 1 MiB (a 16k-token prompt's at top-20 is 5 MiB, past gRPC's default 4 MiB receive
    limit), the output's own last."""
    usage = _usage(output)
    if not output.prompt_logprobs:  # nearly every message
        return (pb.GenerateStreamResponse(request_id=request_id, choices=choices, usage=usage,
                                          finished=output.finished),)
    scored = _prompt_logprobs(output)  # (none for a one-token prompt)
    per_message = max(1, PROMPT_LOGPROB_ENTRIES_PER_MESSAGE // (len(scored[0].top) + 1)
                      if scored else 1)
    pieces = [scored[i : i + per_message] for i in range(0, len(scored), per_message)] or [[]]
    leading = tuple(pb.GenerateStreamResponse(request_id=request_id, usage=usage,
                                              prompt_logprobs=piece) for piece in pieces[:-1])
    return leading + (pb.GenerateStreamResponse(request_id=request_id, choices=choices,
                                                usage=usage, finished=output.finished,
                                                prompt_logprobs=pieces[-1]),)


def _prompt_logprobs(output: RequestOutput) -> list[pb.TokenLogprob]:
    """The prompt's scored tokens (the first has none: it is left out), or nothing."""
    if not output.prompt_logprobs:
        return []
    return [_token_logprob(lp) for lp in output.prompt_logprobs[1:]]


def _completion(c: CompletionOutput, delta: bool) -> pb.Completion:
    logprobs = c.logprobs_delta if delta else c.logprobs
    message = pb.Completion(
        index=c.index,
        text=c.text_delta if delta else c.text,
        token_ids=c.token_ids_delta if delta else c.token_ids,
        logprobs=[_token_logprob(lp) for lp in logprobs or ()],
        finish_reason=FINISH_REASONS[c.finish_reason],
    )
    if c.cumulative_logprob is not None:
        message.cumulative_logprob = c.cumulative_logprob
    if isinstance(c.stop_reason, str):
        message.stop_string = c.stop_reason
    elif isinstance(c.stop_reason, int):
        message.stop_token_id = c.stop_reason
    return message


def _usage(output: RequestOutput) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=sum(c.num_tokens for c in output.outputs),  # token_ids: final only
        cached_tokens=output.num_cached_tokens,
    )
