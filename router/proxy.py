"""One client request through the router: routed, sent to a replica, its stream relayed, and
carried to another replica when its replica fails.

- Before any output reached the client, a replica that is unavailable (down, draining) or whose
  queue is full is skipped and the same request goes to the next choice.
- After output, a replica that fails (the connection drops, or it answers INTERNAL and its
  health check confirms it is gone) is replaced: the request continues on another replica as
  token ids, prompt + the tokens already streamed, with the rest of max_tokens (and min_tokens).
  The client sees one stream whose usage counts the original prompt and every token. Greedy
  output is then token-identical to an uninterrupted run, and its text identical too: the text
  the failed replica held back (a possible start of a stop string, an incomplete character) is
  written by the router (router/resumed_text.py, which also says what is lost without a local
  tokenizer). Sampled output stays a valid sample (a seed restarts on the new replica), and
  presence/frequency penalties only see the tokens generated after the switch. Requests with
  n > 1 are not resumed (UNAVAILABLE).
- Trailing metadata says how it ran, one entry per attempt, in order: `pagedgen-route` the
  policy that chose each (`kv-aware`, `round-robin`, `least-load`, `prefix-hash`,
  `prefix-hash-bounded`, or `prefix-hash-bounded-fallback` when kv-aware had no answer from
  the index: it is down, or one Lookup took longer than `lookup_timeout_s`), and, to a caller
  who may see the deployment's names (no tenants, or may_read_stats), `pagedgen-replicas`
  the replicas.
- Client cancellation and deadlines reach the replica: the upstream call carries the client's
  remaining time and is cancelled with the client's call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.model.sampling_params import SamplingParams
from engine_service.serving.status import cancel_code
from engine_service.serving.validation import REQUEST_ID_PATTERN
from pagedgen_api import generation_pb2 as pb
from router.core import NoReplicaError, Route, Router
from router.relay_buffer import RelayBuffer
from router.replicas import Replica
from router.resumed_text import ResumedText
from tenancy.gate import TENANT_METADATA
from tenancy.request_ids import scoped_request_id

# Refused before it started: the same request can run elsewhere.
_RETRY_BEFORE_OUTPUT = frozenset({grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED})
# May mean the replica died (a dead engine ends its streams with INTERNAL): checked by health.
_MAYBE_DEAD = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                         grpc.StatusCode.CANCELLED})
_HEALTH_CHECK_TIMEOUT_S = 0.5
_WATCH_INTERVAL_S = 0.25  # how often a running attempt checks its replica is still there
DEFAULT_MAX_TOKENS = SamplingParams().max_tokens
log = logging.getLogger("router.proxy")
REPLICA_METADATA = "pagedgen-replicas"
ROUTE_METADATA = "pagedgen-route"


@dataclass(frozen=True, slots=True)
class Failure:
    """How one attempt on a replica ended, when it did not finish."""

    code: grpc.StatusCode
    details: str
    got_output: bool  # this attempt sent the client something


@dataclass(slots=True)
class Progress:
    """One completion as the client has received it."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # its text deltas
    finished: bool = False
    cumulative_logprob: float | None = None  # the latest the client received


def _too_large(error: grpc.aio.AioRpcError) -> bool:
    """gRPC refused a message past its size limit (either end's): RESOURCE_EXHAUSTED too, but
    the request's size, not the replica's load."""
    return (error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "message larger than max" in (error.details() or ""))


def tenant_metadata(tenant: str | None) -> tuple[tuple[str, str], ...] | None:
    """What tells a replica whose request it runs (its Abort is that tenant's alone); an
    engine believes it only from a router's certificate (tenancy/gate.py)."""
    return None if tenant is None else ((TENANT_METADATA, tenant),)


def route_label(route: Route) -> str:
    """The policy that chose a replica, as trailing metadata names it."""
    decision = route.decision
    return f"{decision.policy}-fallback" if decision.fallback else decision.policy


class RoutedRequest:
    def __init__(self, router: Router, request: pb.GenerateRequest,
                 context: grpc.aio.ServicerContext, tenant: str | None = None,
                 sees_replicas: bool = True) -> None:
        self.router = router
        self.request = request  # its cache_salt is the tenant's (router/servicer.py)
        self.context = context
        self.tenant = tenant  # who may Abort it; None: no tenants (an open router)
        self.sees_replicas = sees_replicas  # the client may learn which replicas ran it
        self.progress: dict[int, Progress] = {}
        self.first_usage: pb.Usage | None = None  # from the first replica that answered
        self.resumed_at = 0  # tokens generated before the latest switch of replica
        # The prompt's logprobs (sampling.prompt_logprobs) the client has taken, and how many
        # of a resumed replica's to drop: they come in pieces before the first token, and a
        # replica can fail between two (the next one scores the same prompt again).
        self.prompt_scores_relayed = 0
        self.prompt_scores_to_skip = 0
        # Their logprob sum: a resumed replica's cumulative_logprob counts only its own tokens.
        self.resumed_logprob = 0.0
        self.resumed_text: ResumedText | None = None  # the text, from the first switch on
        self.served_by: list[str] = []  # replicas that ran it, in order (trailing metadata)
        self.routed_by: list[str] = []  # the policy that chose each of them (trailing metadata)
        self.replica: Replica | None = None  # running it now; None while being routed
        self.aborted = False  # the client called Abort: never sent again, ended with ABORT
        self.cut_reason: str | None = None  # the router's drain ended it: UNAVAILABLE, this
        self._call: grpc.aio.UnaryStreamCall | None = None  # the upstream call running now
        self._ended_here = False  # the router cancelled that call for an Abort
        self._refused: grpc.StatusCode | None = None  # the status the router ended it with

    def abort_here(self) -> None:
        """Ends the request at the router (its replica could not be told: down, hung, or it
        had not admitted the request yet): the upstream call is cancelled, which the replica
        sees as the client going away, and the client gets the ABORT ending."""
        self.aborted = True
        self._cancel_upstream()

    def cut(self, reason: str) -> None:
        """Ends the request at the router with UNAVAILABLE and `reason` (its drain ran out of
        time): the upstream call is cancelled, which frees the request's blocks on its
        replica, and the client is told why rather than grpc.aio's "Cancelling all calls"."""
        self.cut_reason = reason
        self._cancel_upstream()

    def _cancel_upstream(self) -> None:
        """The replica's call cancelled by the router (its failure then means that, not the
        replica's fault); nothing when no call runs now."""
        if self._call is not None:
            self._ended_here = True
            self._call.cancel()

    async def _refuse_if_cut(self) -> None:
        if self.cut_reason is not None:
            await self._refuse(grpc.StatusCode.UNAVAILABLE, self.cut_reason)

    async def _refuse(self, code: grpc.StatusCode, message: str) -> None:
        # Counted before the abort: grpc.aio's abort sends the status before it raises, so a
        # client could have its refusal before a count made as the handler unwinds.
        self.router.metrics.failed.labels(code.name).inc()
        self.router.metrics.requests.labels(code.name).inc()
        self._refused = code
        await self.context.abort(code, message)

    async def stream(self) -> AsyncIterator[pb.GenerateStreamResponse]:
        """The request's messages; how the client's call ended is counted once in
        requests_total: OK once its last message went out (or the stream ended), the code the
        router refused it with, CANCELLED when the client went away first (DEADLINE_EXCEEDED
        when its deadline ended it)."""
        code: str | None = None
        timeout_s = self.context.time_remaining()
        send = self.router.send_stalls.open(self.context)
        try:
            async with contextlib.aclosing(self._stream()) as out:
                async for message in out:
                    if message.finished:  # (a consumer may stop reading after it)
                        code = "OK"
                    if not send.headers_sent:
                        await self.router.send_stalls.send_headers(send)
                    send.since = time.monotonic()
                    yield message
                    send.since = None  # written: the transport took it
            code = code or "OK"
        except BaseException as error:
            if self._refused is not None:
                pass  # counted by _refuse, before its status went out
            elif send.stalled:  # (its last message too: the client never had it)
                code = grpc.StatusCode.DEADLINE_EXCEEDED.name
                self.router.metrics.failed.labels(code).inc()
            elif code is None:
                if isinstance(error, asyncio.CancelledError | GeneratorExit):
                    ended = cancel_code(self.context.time_remaining(), timeout_s)
                    if ended == grpc.StatusCode.DEADLINE_EXCEEDED:  # (an error, as a stall)
                        self.router.metrics.failed.labels(ended.name).inc()
                    code = ended.name
                else:  # a bug's exception: gRPC ends the call UNKNOWN
                    code = grpc.StatusCode.UNKNOWN.name
            raise
        finally:
            self.router.send_stalls.close(send)
            if self._refused is None:
                self.router.metrics.requests.labels(code or "OK").inc()

    async def _stream(self) -> AsyncIterator[pb.GenerateStreamResponse]:
        router = self.router
        arrival = time.monotonic()
        upstream = pb.GenerateRequest()
        upstream.CopyFrom(self.request)
        # The router names every request, so Abort can find the replica running it.
        request_id = upstream.request_id = upstream.request_id or uuid.uuid4().hex
        if not REQUEST_ID_PATTERN.fullmatch(request_id):
            await self._refuse(grpc.StatusCode.INVALID_ARGUMENT,
                               f"request_id must be 1 to 128 characters of [A-Za-z0-9._:-] (or "
                               f"empty for a generated one), got {request_id[:60]!r}")
        # Unique among the tenant's own live requests: another tenant may use the same id at
        # once (the engine runs each under its tenant's scope too), and is not told it is live.
        live_key = scoped_request_id(self.tenant, request_id)
        if live_key in router.live:
            await self._refuse(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id must be unique among live requests, got "
                               f"{request_id!r}")
        router.live[live_key] = self
        try:
            token_ids = await router.prompts.token_ids(upstream, router.replicas.routable())
            keep = upstream.sampling.truncate_prompt_tokens
            if token_ids is not None and keep >= 1:  # routed by the tokens that run (-1: by all)
                token_ids = token_ids[-keep:]
            async with contextlib.aclosing(self._attempts(upstream, token_ids, arrival)) as out:
                async for message in out:
                    yield message
        finally:
            router.live.pop(live_key, None)

    async def _attempts(self, upstream: pb.GenerateRequest, token_ids: list[int] | None,
                        arrival: float) -> AsyncIterator[pb.GenerateStreamResponse]:
        router = self.router
        request_id = upstream.request_id
        failed: set[str] = set()
        refusals: list[grpc.StatusCode] = []  # why each attempt that never started failed
        first_route: Route | None = None
        while True:
            prompt_ids = token_ids if not self.resumed_at else list(upstream.token_ids.ids)
            self.replica = None  # being routed: an Abort now ends it here
            await self._refuse_if_cut()
            if self.aborted:
                yield await self._aborted_message(request_id)
                return
            try:
                route = await router.route(prompt_ids, upstream.cache_salt, failed)
            except NoReplicaError as error:
                if refusals and all(c == grpc.StatusCode.RESOURCE_EXHAUSTED for c in refusals):
                    # Every replica tried was full: the client should back off and retry (an
                    # HTTP client gets 429), not take the service for down.
                    await self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"every replica tried is at its request limit; {error}")
                await self._refuse(grpc.StatusCode.UNAVAILABLE, str(error))
            if first_route is None:
                first_route = route
                router.metrics.route_seconds.observe(time.monotonic() - arrival)
            await self._refuse_if_cut()
            if self.aborted:
                yield await self._aborted_message(request_id)
                return
            replica = route.decision.replica
            self.replica = replica
            self.served_by.append(replica.name)
            self.routed_by.append(route_label(route))
            # Which replicas ran the request, and why there: for clients debugging latency, and
            # for tests (a fallback route is legitimate, but says nothing of cache affinity).
            trailing = ((ROUTE_METADATA, ",".join(self.routed_by)),)
            if self.sees_replicas:
                trailing = ((REPLICA_METADATA, ",".join(self.served_by)),) + trailing
            self.context.set_trailing_metadata(trailing)
            failure = None
            finished = False
            async with contextlib.aclosing(self._relay(replica, route, upstream)) as relayed:
                async for message in relayed:
                    if isinstance(message, Failure):
                        failure = message
                        break
                    if message.finished:
                        finished = True
                        self._observe_finished(first_route)
                    yield message
                    if finished:  # (the router may end it first: a stop string, resumed)
                        break
            self.replica = None
            if failure is None or finished:  # (a failure after the last message changes nothing)
                return
            await self._refuse_if_cut()
            if self.aborted:  # aborted while its replica failed, hung, or was cancelled by us
                yield await self._aborted_message(request_id)
                return
            code = failure.code
            gone = code == grpc.StatusCode.UNAVAILABLE or (
                code in _MAYBE_DEAD and not await self._is_serving(replica))
            if gone:
                replica.mark_down(f"{code.name}: {failure.details}")
            if not failure.got_output:  # (with output, the replica had prefilled it)
                router.forget_pending(route)
            if not failure.got_output and (gone or code in _RETRY_BEFORE_OUTPUT):
                # This attempt never started: the same request (a resume included) elsewhere.
                failed.add(replica.address)
                refusals.append(code)
                router.metrics.retries.labels(code.name).inc()
                continue
            if not gone:
                await self._refuse(code, failure.details or code.name)
            failed.add(replica.address)
            resume = self._resume_request(upstream, token_ids)
            if isinstance(resume, str):
                # (Its name and error, which may hold an address, are the operator's.)
                log.warning("request %s: replica %s at %s failed mid-stream (%s: %s); %s",
                            request_id, replica.name, replica.address, code.name,
                            failure.details, resume)
                why = (f"replica {replica.name} failed mid-stream ({code.name}: "
                       f"{failure.details})" if self.sees_replicas
                       else f"its replica failed mid-stream ({code.name})")
                await self._refuse(grpc.StatusCode.UNAVAILABLE, f"{why}; {resume}")
            await self._continue_text(token_ids)
            if isinstance(resume, pb.GenerateStreamResponse):
                if resume.choices:  # with the text the failed replica held back
                    resume.choices[0].text = await self.resumed_text.flush()
                yield resume  # nothing left to generate: its last message
                return
            upstream = resume
            router.metrics.resumed_streams.inc()

    async def _relay(self, replica: Replica, route: Route, upstream: pb.GenerateRequest
                     ) -> AsyncIterator[pb.GenerateStreamResponse | Failure]:
        """The replica's messages as the client gets them; a failure is the last item. A
        replica that goes silent and is found down meanwhile (it hangs, or is partitioned
        away) fails the attempt, so the stream can go on elsewhere instead of waiting. The
        replica's stream is read as it comes, whatever the client's pace (router/relay_buffer.py):
        a client that stops reading stops the request (RESOURCE_EXHAUSTED)."""
        router = self.router
        name = replica.name  # the metric label for the whole attempt
        block_size = router.replicas.hasher.block_size
        # Chains credited as on their way (router/pending.py) count as cached here: the
        # replica prefills them once (unless it admits both requests in one step).
        predicted = route.decision.matched_blocks * block_size
        prompt = route.num_prompt_tokens or 0
        uncached = max(0, prompt - predicted)
        replica.in_flight += 1
        replica.pending_prefill_tokens += uncached
        replica.pending_prompt_tokens += prompt
        router.metrics.in_flight.labels(name).inc()
        call = self._call = replica.stub.GenerateStream(
            upstream, timeout=self.context.time_remaining(), metadata=tenant_metadata(self.tenant))
        self._ended_here = False
        buffer = RelayBuffer(router.config.max_unsent_tokens)
        got_output = False
        lost = False
        released = False
        last_message_at = time.monotonic()

        def release() -> None:
            """The replica no longer runs it: out of its load (once)."""
            nonlocal released, uncached, prompt
            if released:
                return
            released = True
            replica.in_flight -= 1
            replica.num_finished += 1  # its last EngineStats may still count this request
            replica.pending_prefill_tokens -= uncached
            replica.pending_prompt_tokens -= prompt
            uncached = prompt = 0
            router.metrics.in_flight.labels(name).dec()

        async def read() -> None:
            nonlocal got_output, last_message_at, uncached, prompt
            try:
                async for message in call:
                    last_message_at = time.monotonic()
                    # Its first message (a token, or the first chunk of a long prompt: the
                    # engine then reports the rest itself): no longer queued here.
                    if prompt:
                        replica.pending_prefill_tokens -= uncached
                        replica.pending_prompt_tokens -= prompt
                        replica.prefilled_prompt_tokens += prompt
                        uncached = prompt = 0
                    got_output = True
                    if not buffer.put(message):
                        call.cancel()  # the replica aborts it and frees its blocks
                        # It leaves the replica's load now, not when its client reads on.
                        release()
                        buffer.end(Failure(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"the stream was not read: more than {buffer.max_unsent_tokens} "
                            f"tokens (top logprobs counted) waited unsent, past the router's "
                            f"--max-unsent-tokens; the request was stopped: read the stream "
                            f"as it comes", True))
                        return
                buffer.end()
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as error:
                if lost:  # our watchdog cancelled the call, not the client
                    buffer.end(Failure(grpc.StatusCode.UNAVAILABLE,
                                       f"replica {name} went silent and is down "
                                       f"({replica.last_error or 'removed'})", got_output))
                elif self._ended_here:  # Abort cancelled it, not the client
                    buffer.end(Failure(grpc.StatusCode.CANCELLED, "aborted by the client",
                                       got_output))
                elif isinstance(error, grpc.aio.AioRpcError) and _too_large(error):
                    # gRPC's own message size refusal, not a full replica: every replica
                    # would refuse it, so it is the request's fault (not retried).
                    buffer.end(Failure(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"the request is larger than the replica's message size "
                                       f"limit, which its context sets ({error.details()})",
                                       got_output))
                elif isinstance(error, grpc.aio.AioRpcError):
                    buffer.end(Failure(error.code(), error.details() or "", got_output))
                else:
                    raise  # this reader was cancelled: the relay is closing
            finally:
                # (Ends nothing that ended above; here only a bug's exception would reach.)
                buffer.end(Failure(grpc.StatusCode.INTERNAL,
                                   "the router failed relaying the replica's stream",
                                   got_output))

        async def watch() -> None:
            nonlocal lost
            while not reader.done():
                await asyncio.sleep(_WATCH_INTERVAL_S)
                silent_s = time.monotonic() - last_message_at
                if silent_s > router.config.rpc_timeout_s and replica.lost:
                    lost = True
                    call.cancel()
                    return

        reader = asyncio.ensure_future(read())
        watchdog = asyncio.ensure_future(watch())
        try:
            while True:
                message, ended, end = await buffer.get()
                if ended:
                    if end is not None:
                        yield end
                    return
                if self.resumed_text is not None:
                    message = await self._rewrite(message)
                yield self._record(message)
        finally:
            self._call = None
            watchdog.cancel()
            reader.cancel()
            call.cancel()  # the client went away (or we did): the replica aborts it
            release()

    def _record(self, message: pb.GenerateStreamResponse) -> pb.GenerateStreamResponse:
        """Notes what the client receives; after a switch, rewrites usage to the original
        prompt and every token generated."""
        if message.prompt_logprobs:
            skip = min(self.prompt_scores_to_skip, len(message.prompt_logprobs))
            del message.prompt_logprobs[:skip]
            self.prompt_scores_to_skip -= skip
            self.prompt_scores_relayed += len(message.prompt_logprobs)
        for choice in message.choices:
            progress = self.progress.setdefault(choice.index, Progress())
            if choice.HasField("cumulative_logprob"):
                choice.cumulative_logprob += self.resumed_logprob
                progress.cumulative_logprob = choice.cumulative_logprob
            progress.token_ids.extend(choice.token_ids)
            progress.text.append(choice.text)
            if choice.finish_reason:
                progress.finished = True
        if self.first_usage is None:
            self.first_usage = pb.Usage()
        if not self.resumed_at:
            self.first_usage.CopyFrom(message.usage)
            return message
        message.usage.prompt_tokens = self.first_usage.prompt_tokens
        message.usage.cached_tokens = self.first_usage.cached_tokens
        message.usage.completion_tokens += self.resumed_at
        return message

    async def _continue_text(self, prompt_ids: list[int]) -> None:
        """At a switch of replica: the router writes the text from now on."""
        if self.resumed_text is None:
            self.resumed_text = ResumedText(self.router.prompts, self.request.sampling,
                                            prompt_ids, self.router.config.rpc_timeout_s)
        progress = self.progress.get(0, Progress())
        await self.resumed_text.switch(self.router.replicas.routable(), progress.token_ids,
                                       "".join(progress.text))

    async def _rewrite(self, message: pb.GenerateStreamResponse) -> pb.GenerateStreamResponse:
        """A resumed stream's message with the router's text; ended where a stop string that
        began before the switch completes (the replica cannot see it), as the engine would."""
        for choice in message.choices:  # one: n > 1 is never resumed
            kept = await self.resumed_text.rewrite(choice)
            if kept is None:
                continue
            message.usage.completion_tokens -= len(choice.token_ids) - kept
            if choice.HasField("cumulative_logprob"):
                choice.cumulative_logprob -= sum(lp.logprob for lp in choice.logprobs[kept:])
            del choice.token_ids[kept:]
            del choice.logprobs[kept:]
            choice.finish_reason = pb.FINISH_REASON_STOP
            choice.stop_string = self.resumed_text.matched_stop
            message.finished = True
        return message

    def _resume_request(self, upstream: pb.GenerateRequest, token_ids: list[int] | None
                        ) -> pb.GenerateRequest | pb.GenerateStreamResponse | str:
        """The request that continues the stream elsewhere; its last message when nothing is
        left to generate; why not, when it cannot be continued."""
        sampling = self.request.sampling
        n = sampling.n if sampling.HasField("n") else 1
        if n != 1:
            return "a request with n > 1 cannot be resumed on another replica"
        if token_ids is None or self.first_usage is None:
            return ("its prompt could not be tokenized by the router, so it cannot be resumed "
                    "on another replica")
        progress = self.progress.get(0, Progress())
        generated = len(progress.token_ids)
        if sampling.bad_words and generated and not progress.finished:
            # The words are read in the output, which would start again on the new replica:
            # a word begun before the switch could be finished after it.
            return ("a request with bad_words cannot be resumed on another replica once it "
                    "has output")
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        if progress.finished or generated >= max_tokens:
            return self._length_message(upstream.request_id, generated, progress)
        resume = pb.GenerateRequest()
        resume.CopyFrom(self.request)
        resume.request_id = upstream.request_id
        if sampling.HasField("truncate_prompt_tokens"):
            # The prompt as the first replica ran it (its last prompt_tokens): cut again with
            # the generated tokens after it, it would lose some of its own.
            token_ids = token_ids[max(0, len(token_ids) - self.first_usage.prompt_tokens):]
            resume.sampling.ClearField("truncate_prompt_tokens")
        resume.token_ids.ids[:] = token_ids + progress.token_ids  # replaces text / chat
        resume.sampling.max_tokens = max_tokens - generated
        resume.sampling.min_tokens = max(0, sampling.min_tokens - generated)
        if resume.sampling.HasField("structured_outputs"):  # its grammar goes on after them
            resume.sampling.structured_outputs.resumed_tokens += generated
        if generated:  # every piece of the prompt's logprobs came before the first token
            resume.sampling.ClearField("prompt_logprobs")
        else:  # the same prompt, scored again: what the client has is not sent twice
            self.prompt_scores_to_skip = self.prompt_scores_relayed
        self.resumed_at = generated
        self.resumed_logprob = progress.cumulative_logprob or 0.0
        return resume

    def _length_message(self, request_id: str, generated: int, progress: Progress
                        ) -> pb.GenerateStreamResponse:
        usage = pb.Usage(prompt_tokens=self.first_usage.prompt_tokens,
                         cached_tokens=self.first_usage.cached_tokens,
                         completion_tokens=generated)
        choices = [] if progress.finished else [
            pb.Completion(index=0, finish_reason=pb.FINISH_REASON_LENGTH)]
        return pb.GenerateStreamResponse(request_id=request_id, choices=choices, usage=usage,
                                         finished=True)

    async def _aborted_message(self, request_id: str) -> pb.GenerateStreamResponse:
        """The last message of a request the router ended for an Abort: every unfinished
        completion ends with ABORT (with the text held back, as an engine's abort releases
        it), and usage counts what the client received."""
        sampling = self.request.sampling
        n = sampling.n if sampling.HasField("n") else 1
        message = pb.GenerateStreamResponse(
            request_id=request_id, finished=True,
            choices=[pb.Completion(index=i, finish_reason=pb.FINISH_REASON_ABORT)
                     for i in range(n) if not self.progress.get(i, Progress()).finished])
        if self.first_usage is not None:
            message.usage.prompt_tokens = self.first_usage.prompt_tokens
            message.usage.cached_tokens = self.first_usage.cached_tokens
            message.usage.completion_tokens = sum(len(p.token_ids)
                                                  for p in self.progress.values())
        if self.resumed_text is not None and message.choices:
            message.choices[0].text = await self.resumed_text.flush()
        return message

    async def _is_serving(self, replica: Replica) -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(replica.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=_HEALTH_CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _observe_finished(self, first_route: Route) -> None:
        metrics = self.router.metrics
        name = first_route.decision.replica.name
        block_size = self.router.replicas.hasher.block_size
        usage = self.first_usage or pb.Usage()
        metrics.predicted_cached_tokens.labels(name).inc(
            min(first_route.index_matched_blocks * block_size, usage.prompt_tokens))
        metrics.actual_cached_tokens.labels(name).inc(usage.cached_tokens)
        metrics.prompt_tokens.labels(name).inc(usage.prompt_tokens)
