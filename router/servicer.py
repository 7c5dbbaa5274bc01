"""pagedgen.generation.v1.Generation served by the router: generation routed per request
(router/proxy.py), the other calls forwarded to a replica, so clients, stubs and grpcurl
cannot tell the router from an engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import PurePath

import grpc

from engine_service.serving.send_stall import SendStallWatch
from engine_service.serving.status import RequestRejected
from engine_service.serving.validation import (
    CHARS_PER_CONTEXT_TOKEN,
    MAX_CACHE_SALT_CHARS,
    check_chat_size,
    check_text_size,
)
from engine_service.serving.wire_errors import GENERATE_METHODS
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from router.config import DEFAULT_CONTEXT_TOKENS
from router.core import NoReplicaError, Router
from router.proxy import RoutedRequest, tenant_metadata
from router.relay_buffer import merge_messages
from router.replicas import Replica
from tenancy.door import TenantDoor, TenantRefused
from tenancy.gate import Caller
from tenancy.request_ids import scoped_request_id

log = logging.getLogger("router.servicer")


class RouterServicer(pb_grpc.GenerationServicer):
    def __init__(self, router: Router, door: TenantDoor | None = None,
                 max_context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> None:
        self.router = router
        # Prompts are sized against the longest context among the replicas; this one until
        # a replica has said its own (--max-context-tokens).
        self.max_context_tokens = max_context_tokens
        # Who calls, and what their tenant may do (tenancy/): the router is the front door, so
        # tenants' limits are counted here and their salts derived here, the engines told
        # the tenant (x-pagedgen-tenant) for Abort only.
        self.door = door or TenantDoor()
        self.draining = False
        self._turn = 0  # where the next forwarded call starts among the replicas

    async def _refuse_if_draining(self, context, count_failed: bool = True) -> None:
        """While draining, new work is refused (as an engine does); `count_failed`: a generation
        request, counted among the failed ones as the engine counts it among the rejected."""
        if self.draining:
            if count_failed:
                self._count_refused(grpc.StatusCode.UNAVAILABLE)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the router is draining (shutting down): retry on another one")

    @property
    def send_stalls(self) -> SendStallWatch:
        """The router's watch of its clients' streams (the HTTP API counts its own stalls
        with it)."""
        return self.router.send_stalls

    def count_refused_call(self, method: str, code: grpc.StatusCode) -> None:
        """A call the interceptors refused before it reached us (no valid key: UNAUTHENTICATED;
        bytes that did not decode: INVALID_ARGUMENT): counted as our own refusals are when it
        was a generation request, once (each interceptor refuses and tells only its own)."""
        if method in GENERATE_METHODS:
            self._count_refused(code)

    def _count_refused(self, code: grpc.StatusCode) -> None:
        """A generation request refused before it was routed: a failed one, and one of all
        (requests_total; RoutedRequest counts the routed ones)."""
        self.router.metrics.failed.labels(code.name).inc()
        self.router.metrics.requests.labels(code.name).inc()

    # ---- generation -------------------------------------------------------------------------
    async def GenerateStream(self, request: pb.GenerateRequest, context
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async with contextlib.aclosing(self._routed(request, context)) as messages:
            async for message in messages:
                yield message

    async def _routed(self, request: pb.GenerateRequest, context
                      ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """The request routed as its tenant's: its salt, its limits, its Abort."""
        caller = await self.door.caller(context)
        await self._refuse_if_draining(context)
        await self._refuse_oversized(request, context)
        salted = await self._salted(caller, request, context, count_failed=True)
        try:
            self.door.check_priority(caller, request.priority)
            self.door.enter(caller)
        except TenantRefused as error:
            self._count_refused(error.code)
            await context.abort(error.code, error.message)
        try:
            routed = RoutedRequest(self.router, salted, context, caller.tenant,
                                   self.door.shows_internals(caller))
            async with contextlib.aclosing(routed.stream()) as messages:
                async for message in messages:
                    yield message
        finally:
            self.door.leave(caller)

    async def _refuse_oversized(self, request, context, count_failed: bool = True) -> None:
        """A prompt's token count, a chat's message count and size, or a text's size, refused
        here as an engine refuses them, before anything reads them further (the local
        tokenizer renders a chat message by message: half a million empty ones took seconds of
        the router's tokenizer thread)."""
        which = request.WhichOneof("input")
        if which not in ("chat", "text", "token_ids"):
            return
        context_tokens = self._context_tokens()
        max_chars = CHARS_PER_CONTEXT_TOKEN * context_tokens
        try:
            if which == "token_ids":
                # Refused here, as the engine would: forwarded, a prompt far past the context
                # is past the engine's message size limit (sized to its context), a refusal
                # that says nothing of the prompt. Cut first where the request asks.
                cut_token_ids(request, context_tokens)
                check_token_ids_size(request, context_tokens)
            elif which == "chat":
                check_chat_size(request.chat, max_chars)
            else:
                check_text_size(request.text, max_chars)
        except RequestRejected as error:
            if count_failed:
                self._count_refused(error.code)
            await context.abort(error.code, error.message)

    def _context_tokens(self) -> int:
        """The longest context among the routable replicas (--max-context-tokens until one
        has said its own)."""
        lengths = [r.info.max_model_len for r in self.router.replicas.routable()
                   if r.info is not None]
        return max(lengths) if lengths else self.max_context_tokens

    async def _salted(self, caller: Caller, request, context, count_failed: bool = False):
        """`request` (a GenerateRequest or PinPrefixRequest) with its tenant's cache salt, the
        one the engines hash with: routes read the same chains as the engines hold."""
        if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:  # (as the engine says it)
            if count_failed:
                self._count_refused(grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, "
                                f"got {len(request.cache_salt)}")
        salt = self.door.cache_salt(caller, request.cache_salt)
        if salt == request.cache_salt:
            return request
        salted = type(request)()
        salted.CopyFrom(request)
        salted.cache_salt = salt
        return salted

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        """The stream, gathered: a unary request is resumed like a stream when its replica
        fails."""
        gathered = pb.GenerateStreamResponse()  # the messages merged as a slow reader's are
        received = False
        async with contextlib.aclosing(self._routed(request, context)) as messages:
            async for message in messages:
                if received:
                    merge_messages(gathered, message)
                else:
                    gathered.CopyFrom(message)
                    received = True
        if not gathered.finished:
            await context.abort(grpc.StatusCode.INTERNAL,
                                "the replica's stream ended without its last message")
        return pb.GenerateResponse(
            request_id=gathered.request_id,
            completions=sorted(gathered.choices, key=lambda choice: choice.index),
            usage=gathered.usage, prompt_logprobs=gathered.prompt_logprobs)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        caller = await self.door.caller(context)
        routed = self.router.live.get(scoped_request_id(caller.tenant, request.request_id))
        if routed is None or routed.tenant != caller.tenant:  # another tenant's: as unknown
            return pb.AbortResponse(found=False)
        routed.aborted = True  # never sent (again): not routed, not resumed elsewhere
        replica = routed.replica
        if replica is None:  # being routed, or between replicas: it ends before it is sent
            return pb.AbortResponse(found=True)
        remaining = context.time_remaining()
        timeout = self.router.config.rpc_timeout_s
        try:
            reply = await replica.stub.Abort(
                request, timeout=timeout if remaining is None else min(remaining, timeout),
                metadata=tenant_metadata(routed.tenant))
            if reply.found:  # the replica ends the stream with ABORT
                return pb.AbortResponse(found=True)
        except grpc.aio.AioRpcError:
            pass  # down or hung: the router ends it
        # The replica could not end it (it has not admitted it yet, or cannot answer).
        if routed.replica is replica:
            routed.abort_here()
        return pb.AbortResponse(found=True)

    # ---- forwarded ----------------------------------------------------------------------------
    async def _forward(self, context, method: str, request, replicas: list[Replica] | None = None,
                       metadata=None, long_running: bool = False):
        """`method` on the first of `replicas` (default: every routable one) that is up; its
        error, if it answers with one, is the client's. A long-running call (PinPrefix computes
        its prefix) runs under the client's deadline alone, and its deadline passing is the
        client's error, not a sign the replica stalls."""
        if replicas is None:  # spread: each call starts at the next replica
            routable = self.router.replicas.routable()
            self._turn += 1
            start = self._turn % max(1, len(routable))
            replicas = routable[start:] + routable[:start]
        last_error = None
        own_timeout = self.router.config.rpc_timeout_s
        for replica in replicas:
            remaining = context.time_remaining()
            if long_running:
                timeout = remaining
            else:
                timeout = own_timeout if remaining is None else min(remaining, own_timeout)
            try:
                return await getattr(replica.stub, method)(request, timeout=timeout,
                                                           metadata=metadata)
            except grpc.aio.AioRpcError as error:
                code = error.code()
                # Our own deadline passing means this replica stalls: try the next one.
                stalled = (not long_running and code == grpc.StatusCode.DEADLINE_EXCEEDED
                           and (remaining is None or remaining > own_timeout))
                if code != grpc.StatusCode.UNAVAILABLE and not stalled:
                    await context.abort(code, error.details() or code.name)
                replica.mark_down(f"{code.name}: {error.details()}")
                last_error = error
        # Counts only: a connection's error names the replica's address, the deployment's.
        if last_error is not None:
            log.warning("no replica answered %s; last: %s", method, last_error.details())
            detail = f" ({len(replicas)} tried)"
        else:
            detail = f" ({self.router.details().get('replicas', '0')} known)"
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"no engine replica answered {method}{detail}")

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        await self._refuse_oversized(request, context, count_failed=False)
        return await self._forward(context, "Tokenize", request)

    async def Detokenize(self, request: pb.DetokenizeRequest, context
                         ) -> pb.DetokenizeResponse:
        limit = self._context_tokens()  # (as the engines count them, before they are sent)
        if len(request.token_ids) > limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids must hold at most {limit} ids (the replicas' "
                                f"context), got {len(request.token_ids)}")
        return await self._forward(context, "Detokenize", request)

    async def ModelInfo(self, request: pb.ModelInfoRequest, context) -> pb.ModelInfoResponse:
        caller = await self.door.caller(context)
        reply = await self._forward(context, "ModelInfo", request)
        if not self.door.shows_internals(caller):  # which replica and where: the operator's
            reply.model_path = PurePath(reply.model_path).name
            reply.engine_id = reply.instance_id = ""
        return reply

    async def PinPrefix(self, request: pb.PinPrefixRequest, context) -> pb.PinPrefixResponse:
        """Pinned on the replica the prefix routes to (where its requests will go); not a
        routing decision of the metrics. Refused while draining, like generation: a pin is
        work for the requests that follow, which should go to another router."""
        caller = await self.door.caller(context)
        await self._refuse_if_draining(context, count_failed=False)
        await self._refuse_oversized(request, context, count_failed=False)
        request = await self._salted(caller, request, context)
        router = self.router
        token_ids = await router.prompts.token_ids(request, router.replicas.routable())
        try:
            route = await router.route(token_ids, request.cache_salt, set(), record=False)
        except NoReplicaError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        chain = list(route.chain)  # what the replica will pin (hashed as it hashes them)
        metadata = tenant_metadata(caller.tenant)
        if request.unpin:  # wherever a pin went (routes change): every replica unpins
            reply = await self._unpin_everywhere(context, request, metadata, len(chain))
            self.door.record_unpin(caller, chain)
            return reply
        try:
            reservation = self.door.reserve_pin(caller, chain, request.ttl_s)
        except TenantRefused as error:
            await context.abort(error.code, error.message)
        try:
            reply = await self._forward(context, "PinPrefix", request,
                                        [route.decision.replica], metadata, long_running=True)
        except BaseException:
            self.door.cancel_pin(reservation)
            raise
        return reply

    async def _unpin_everywhere(self, context, request: pb.PinPrefixRequest, metadata,
                                num_blocks: int) -> pb.PinPrefixResponse:
        """The unpin on every routable replica; the blocks they unpinned, summed. A replica
        that does not answer keeps its pins until their TTL (it may be gone anyway)."""
        replicas = self.router.replicas.routable()
        if not replicas:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine replica to unpin on")
        remaining = context.time_remaining()
        own = self.router.config.rpc_timeout_s
        timeout = own if remaining is None else min(remaining, own)
        replies = await asyncio.gather(*(
            replica.stub.PinPrefix(request, timeout=timeout, metadata=metadata)
            for replica in replicas), return_exceptions=True)
        answered = [r for r in replies if isinstance(r, pb.PinPrefixResponse)]
        refused = [r for r in replies if isinstance(r, grpc.aio.AioRpcError)
                   and r.code() not in (grpc.StatusCode.UNAVAILABLE,
                                        grpc.StatusCode.DEADLINE_EXCEEDED)]
        if refused:  # the request itself is wrong: every replica says the same
            await context.abort(refused[0].code(), refused[0].details() or "")
        if not answered:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "no engine replica answered the unpin")
        return pb.PinPrefixResponse(num_blocks=num_blocks,
                                    num_pinned=sum(r.num_pinned for r in answered))

    async def EngineStats(self, request: pb.EngineStatsRequest, context
                          ) -> pb.EngineStatsResponse:
        """Every routable replica's stats summed (usage: over all their blocks); the router's
        own state in index_details. The operator's: a tenant needs may_read_stats."""
        caller = await self.door.caller(context)
        try:
            self.door.check_stats(caller, "EngineStats")
        except TenantRefused as error:
            await context.abort(error.code, error.message)
        total = pb.EngineStatsResponse(draining=self.draining)
        used_blocks = 0.0
        remaining = context.time_remaining()
        timeout = self.router.config.rpc_timeout_s
        if remaining is not None:
            timeout = min(timeout, remaining)

        async def ask(replica: Replica) -> pb.EngineStatsResponse | None:
            try:
                return await replica.stub.EngineStats(request, timeout=timeout)
            except grpc.aio.AioRpcError:
                return None  # down or hung: left out of the sums

        # All at once: one hung replica costs the timeout once, not once per replica.
        replies = await asyncio.gather(*(ask(r) for r in self.router.replicas.routable()))
        for stats in replies:
            if stats is None:
                continue
            for name in ("num_blocks", "num_free_blocks", "num_cached_blocks", "num_running",
                         "num_waiting", "num_swapped", "prefix_cache_queries",
                         "prefix_cache_hits", "num_preemptions", "num_steps",
                         "num_live_requests", "num_waiting_prefill_tokens",
                         "pin_budget_blocks", "num_pinned_blocks"):
                setattr(total, name, getattr(total, name) + getattr(stats, name))
            used_blocks += stats.kv_cache_usage * stats.num_blocks
            total.degraded = total.degraded or stats.degraded
        if total.num_blocks:
            total.kv_cache_usage = used_blocks / total.num_blocks
        if total.prefix_cache_queries:
            total.prefix_cache_hit_rate = total.prefix_cache_hits / total.prefix_cache_queries
        total.index_details.update(self.router.details())
        return total


def cut_token_ids(request, context_tokens: int) -> None:
    """A generation's token-id prompt cut to its last truncate_prompt_tokens, as the engine
    cuts it (-1: to the longest prompt the context takes); a value the engine refuses is left
    for it to refuse."""
    if not isinstance(request, pb.GenerateRequest) or not request.sampling.HasField(
            "truncate_prompt_tokens"):
        return
    keep = request.sampling.truncate_prompt_tokens
    keep = context_tokens - 1 if keep == -1 else keep
    if keep >= 1 and len(request.token_ids.ids) > keep:
        del request.token_ids.ids[:len(request.token_ids.ids) - keep]


def check_token_ids_size(request, context_tokens: int) -> None:
    """A prompt of token ids longer than the replicas' context, refused as the engine words it
    (a generation keeps one token of the context for its output; a pin may fill it)."""
    num_ids = len(request.token_ids.ids)
    if isinstance(request, pb.GenerateRequest):
        if num_ids >= context_tokens:
            raise RequestRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt must be at most {context_tokens - 1} tokens (the {context_tokens}-token "
                f"context keeps one for the output), got {num_ids} tokens")
    elif num_ids > context_tokens:
        raise RequestRejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"token_ids must hold at most {context_tokens} ids (the replicas' context), got "
            f"{num_ids}")
