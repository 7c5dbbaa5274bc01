"""The OpenAI-compatible HTTP API as a Starlette app over a Backend (the engine's or the
router's servicer): handlers parse, map to a GenerateRequest, call the servicer, render.

    POST /v1/completions, POST /v1/chat/completions (stream: true -> server-sent events)
    GET /v1/models, GET /health, POST /tokenize, POST /detokenize, GET /version
    POST /pin_prefix (pagedgen's: keep a prefix cached, computing it first; PinPrefix)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable
from http import HTTPStatus
from importlib import metadata
from typing import TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine_service.serving.send_stall import SendStallWatch
from engine_service.serving.validation import MAX_CHAT_MESSAGES
from openai_api import schemas
from openai_api.auth import ApiKeyCheck
from openai_api.backend import Backend, ServedModel
from openai_api.call_context import CallAborted, HttpCallContext, StreamCalls
from openai_api.disconnect import ClientGone, EventStream, unless_disconnected
from openai_api.errors import ApiError, from_status
from openai_api.from_engine import Renderer
from openai_api.reasoning_parsers import continued_state, prompt_state
from openai_api.to_engine import (
    CHAT_TURN_NAMES,
    EngineCall,
    chat_call,
    chat_messages,
    check_token_count,
    completion_call,
    kept_tokens,
    rest_of_context,
    set_chat_turn,
    template_kwargs_json,
)
from openai_api.tool_calls import tools_json
from pagedgen_api import generation_pb2 as pb
from tenancy.gate import Gate

DONE = b"data: [DONE]\n\n"
# How long a request's body may go without a byte arriving (from its head, then from each
# part): nginx's client_body_timeout is 60 s. A body sent a byte at a time held its connection
# and handler for good, and an honest 10 MB body at 100 KB/s was refused when this bounded the
# whole body.
BODY_TIMEOUT_S = 60.0
# Past its first BODY_TIMEOUT_S a body must also keep this pace on average (Apache
# mod_reqtimeout's MinRate, 500 bytes/s): a byte every 59 s is not refused by the timeout above,
# and held a handler for up to MAX_BODY_BYTES minutes. So a body takes at most
# BODY_TIMEOUT_S + MAX_BODY_BYTES / BODY_MIN_BYTES_PER_S in all, and less the less it sends.
BODY_MIN_BYTES_PER_S = 500
CALLER_SCOPE_KEY = "pagedgen.caller"
log = logging.getLogger("openai_api.app")
T = TypeVar("T")


def create_app(backend: Backend, gate: Gate | None = None,
               body_timeout_s: float = BODY_TIMEOUT_S,
               send_stall_timeout_s: float = 0.0,
               tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> Starlette:
    """`tool_call_parser`: how tool calls are read out of the model's text for tool_choice
    "auto" (tool_parsers.PARSERS); None: "auto" with tools is refused. `reasoning_parser`:
    how chat replies' thinking is told from the answer (reasoning_parsers.PARSERS); None: all
    of a reply is content."""
    api = _Api(backend, body_timeout_s, send_stall_timeout_s, tool_call_parser,
               reasoning_parser)
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/version", api.version, methods=["GET"]),
        Route("/pin_prefix", api.pin_prefix, methods=["POST"]),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(_Authenticated, check=ApiKeyCheck(gate)),
                    Middleware(_InternalErrors)],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error})


class _Authenticated:
    """The API key check before routing, so a wrong key on an unknown path is still a 401;
    the caller it finds goes with the request (scope[CALLER_SCOPE_KEY]) to the servicer."""

    def __init__(self, app: ASGIApp, check: ApiKeyCheck) -> None:
        self.app, self.check = app, check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization")
            try:
                scope[CALLER_SCOPE_KEY] = self.check.check(
                    scope["path"], None if auth is None else auth.decode("latin-1"))
            except ApiError as error:
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return _error_response(error)


def _error_response(error: ApiError) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if error.status == HTTPStatus.UNAUTHORIZED else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    status = HTTPStatus(error.status_code)
    detail = (f"{request.method} {request.url.path} is not served here"
              if status in (HTTPStatus.NOT_FOUND, HTTPStatus.METHOD_NOT_ALLOWED)
              else str(error.detail))
    return JSONResponse(ApiError(status, detail).body(), status_code=status,
                        headers=error.headers)


_INTERNAL_ERROR = ApiError(HTTPStatus.INTERNAL_SERVER_ERROR,
                           "the server failed to answer this request (an internal error; its "
                           "log has the details)", code="internal_error")


_STOPPED = ApiError(HTTPStatus.SERVICE_UNAVAILABLE,
                    "the server is shutting down (its drain's grace ran out) before this "
                    "request finished: retry the request", code="unavailable")


class _InternalErrors:
    """A bug's 500, still in OpenAI's shape (clients parse `error` whatever the status), the
    exception itself not told (it may carry internals) but logged. Handled here, not by
    Starlette's 500 handler: that one re-raises to uvicorn, which then closes the connection
    under a keep-alive client's feet (the openai client saw a reset, not the 500)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except asyncio.CancelledError:
            # The server stops with this request still running (the drain's grace ran out):
            # the client is told to retry, as a stream is (SHUTTING_DOWN), where uvicorn would
            # answer a plain-text 500. The cancellation goes on either way.
            if not started and scope["type"] == "http":
                with contextlib.suppress(Exception):
                    await JSONResponse(_STOPPED.body(), status_code=_STOPPED.status)(
                        scope, receive, send)
            raise
        except Exception:
            if started or scope["type"] != "http":
                raise  # the status is sent: only closing the connection is left
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            await JSONResponse(_INTERNAL_ERROR.body(),
                               status_code=HTTPStatus.INTERNAL_SERVER_ERROR)(scope, receive, send)


class _Api:
    def __init__(self, backend: Backend, body_timeout_s: float,
                 send_stall_timeout_s: float, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.backend = backend
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.servicer = backend.servicer
        self.body_timeout_s = body_timeout_s
        self.send_stall_timeout_s = send_stall_timeout_s  # 0: streams never ended for it
        # Stalls counted and logged with the servicer's own gRPC ones (engine or router); a
        # servicer without a watch gets one for its log lines.
        self.send_stalls = (getattr(self.servicer, "send_stalls", None)
                            or SendStallWatch(send_stall_timeout_s, "this server's"))

    def _send_stalled(self, calls: StreamCalls, waited_s: float) -> None:
        """A stream's client took nothing for send_stall_timeout_s (disconnect.py EventStream
        closes it): counted and logged as the servicer's own gRPC ones, and its calls end as
        theirs do."""
        calls.end_for_stall()
        self.send_stalls.stalled(waited_s)

    async def _body(self, request: Request) -> bytes:
        return await _body(request, self.body_timeout_s)

    # ---- generation -------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = schemas.parse(schemas.CompletionRequest, await self._body(request))
        model = self._model(body.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        # (as the engine counts them: its default max_tokens, 16, and n sequences)
        longest = model.longest_prompt(body.n or 1, 1 if body.max_tokens == 0
                                       else body.max_tokens or 16
                                       ) if body.truncate_prompt_tokens == -1 else 0
        call = completion_call(body, request_id, model.prompt_context, longest)
        echo = None if call.echo_prompts is None else functools.partial(
            self._prompt_texts, request, call)
        kept = kept_tokens(body.truncate_prompt_tokens, longest)
        first_ids = None
        if call.scores_prompt or (echo is not None and kept is not None):
            first_ids = await self._as_token_ids(request, call, kept)
            if echo is not None and kept is not None:  # what ran: a cut prompt's kept tokens
                call.echo_prompts = [list(wire.token_ids.ids) for wire in call.requests]
            if not call.scores_prompt:
                first_ids = None
        return await self._answer(request, call, Renderer(
            request_id, body.model or model.name, False, call.n, call.logprobs,
            self.backend.token_texts, self.backend.token_bytes, echo,
            first_prompt_ids=first_ids, echo_only=call.echo_only,
            prompt_logprobs=call.prompt_logprobs,
            tokens_as_ids=bool(body.return_tokens_as_token_ids)))

    async def _as_token_ids(self, request: Request, call: EngineCall, kept: int | None = None
                            ) -> list[int]:
        """Echo with logprobs (or a cut prompt echoed): each text prompt tokenized (as
        Generate would), cut to its last `kept` tokens (truncate_prompt_tokens), and sent as
        its token ids, so it is tokenized once; each prompt's first token id (its logprob
        entry leads, and only the tokens tell it)."""
        texts = [(wire, names) for wire, names in zip(call.requests, call.field_names,
                                                      strict=True)
                 if wire.WhichOneof("input") == "text"]
        replies = await _all_or_none(
            self._unary("Tokenize", pb.TokenizeRequest(text=wire.text), names, _caller(request))
            for wire, names in texts)
        for (wire, _), reply in zip(texts, replies, strict=True):
            ids = list(reply.token_ids)
            wire.token_ids.ids[:] = ids if kept is None else ids[-kept:]  # replaces the text
        # An empty id list ([[]]) is Generate's to refuse, which it does before anything is
        # rendered: its placeholder is never read.
        return [wire.token_ids.ids[0] if wire.token_ids.ids else -1 for wire in call.requests]

    async def _prompt_texts(self, request: Request, call: EngineCall) -> list[str]:
        """The text of each prompt to echo: a text prompt's own, a token-id prompt's decoded
        with its special tokens (what the model was given). Asked for once the servicer has
        accepted the request: a refused one costs no decoding."""
        texts = []
        for prompt, names in zip(call.echo_prompts, call.field_names, strict=True):
            if isinstance(prompt, str):
                texts.append(prompt)
                continue
            wire = pb.DetokenizeRequest(token_ids=prompt, skip_special_tokens=False)
            reply = await self._unary("Detokenize", wire, {"token_ids": names["prompt"]},
                                      _caller(request))
            texts.append(reply.text)
        return texts

    async def chat_completions(self, request: Request) -> Response:
        raw = await self._body(request)
        schemas.check_message_count(raw, MAX_CHAT_MESSAGES)
        body = schemas.parse(schemas.ChatCompletionRequest, raw)
        model = self._model(body.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        call = chat_call(body, request_id, self.tool_call_parser, self.reasoning_parser)
        prompt_end = None
        if call.to_end_of_context or call.reasoning_parser is not None:
            wire = call.requests[0]
            # (read now: rest_of_context replaces the chat with its tokens)
            continued = (wire.chat.messages[-1].content if wire.chat.continue_final_message
                         else None)
            reply = await self._unary("Tokenize", pb.TokenizeRequest(chat=wire.chat),
                                      call.field_names[0], _caller(request))
            if call.to_end_of_context:
                ids = list(reply.token_ids)
                longest = (model.longest_prompt(call.n, 1)
                           if body.truncate_prompt_tokens == -1 else 0)
                kept = kept_tokens(body.truncate_prompt_tokens, longest)
                rest_of_context(wire, ids if kept is None else ids[-kept:],
                                model.longest_sequence(call.n))
            else:  # sent as its tokens: the template is rendered once a request
                wire.token_ids.ids[:] = reply.token_ids  # (replaces the chat: the oneof)
            if call.reasoning_parser is not None:
                # A template may open the thinking for the model, or close it (thinking
                # off): the reply starts where the prompt left it. (Held to a schema from
                # its first token, an output does not start inside the thinking.)
                prompt_end = prompt_state(reply.prompt)
                if continued is not None:  # its own tags say, not the template's
                    prompt_end = continued_state(continued) or prompt_end
                if prompt_end == "open" and call.constrained:
                    prompt_end = None
        return await self._answer(request, call, Renderer(
            request_id, body.model or model.name, True, call.n, call.logprobs,
            self.backend.token_texts, self.backend.token_bytes,
            prompt_logprobs=call.prompt_logprobs, forced_calls=call.forced_calls,
            tool_call_parser=call.tool_call_parser, one_call=call.one_call,
            reasoning_parser=call.reasoning_parser, reasoning_prompt_end=prompt_end,
            tokens_as_ids=bool(body.return_tokens_as_token_ids)))

    def _model(self, name: str | None) -> ServedModel:
        """The served model `name` asks for (404 when none by that name); None asks for the
        default, the first."""
        served = self.backend.models()
        if not served:  # no replica known yet: the servicer says what is wrong
            return ServedModel(name or "", 0, 0, 1)
        if name is None:
            return served[0]
        for model in served:
            if model.name == name:
                return model
        raise ApiError(HTTPStatus.NOT_FOUND,
                       f"model must be one of {', '.join(json.dumps(m.name) for m in served)} "
                       f"(GET /v1/models), got {json.dumps(name)}", "model", "model_not_found")

    async def _answer(self, request: Request, call: EngineCall, render: Renderer) -> Response:
        if call.stream:
            calls = StreamCalls(_caller(request))
            events = self._events(call, render, calls)
            try:  # the first event decides the status: a refusal is an HTTP error, not a stream
                first = await unless_disconnected(request.receive, anext(events))
            except ClientGone:
                await events.aclose()
                return Response(status_code=499)
            except asyncio.CancelledError:  # the server stops: _InternalErrors answers 503
                await events.aclose()
                raise
            return EventStream(_prepend(first, events), SHUTTING_DOWN,
                               self.send_stall_timeout_s,
                               functools.partial(self._send_stalled, calls))
        try:
            replies = await unless_disconnected(request.receive, _all_or_none(
                self._unary("Generate", r, names, _caller(request))
                for r, names in zip(call.requests, call.field_names, strict=True)))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it (nginx's code for the case)
        return JSONResponse(await render.response(replies))

    async def _unary(self, method: str, message, field_names: dict[str, str], caller):
        try:
            return await getattr(self.servicer, method)(message, HttpCallContext(caller))
        except CallAborted as aborted:
            raise from_status(aborted.code, aborted.details, field_names) from None

    async def _events(self, call: EngineCall, render: Renderer, calls: StreamCalls
                      ) -> AsyncGenerator[bytes, None]:
        """The stream's events; a refusal before the first one raises ApiError, one after it
        is an error event (the status is sent by then)."""
        usages = [pb.Usage() for _ in call.requests]
        started = False
        try:
            async with contextlib.aclosing(self._messages(call, calls)) as messages:
                async for prompt_index, message in messages:
                    if not started:
                        # Before the first event: a refusal of what it needs is the
                        # response's status, not an error event.
                        await render.prepare()
                        started = True
                        for chunk in render.role_chunks(len(call.requests)):
                            yield _event(chunk)
                    usages[prompt_index] = message.usage
                    usage = render.usage(usages) if call.continuous_usage else None
                    for choice in await render.stream_choices(prompt_index, message):
                        yield _event(render.chunk([choice], usage))
        except ApiError as error:
            if not started:
                raise
            yield _event(error.body())
        except Exception:
            if not started:
                raise  # the 500 handler answers
            # The status is sent: the client still gets an error event and [DONE], not a
            # broken body; the traceback goes to the log alone.
            log.exception("stream %s failed", render.request_id)
            yield _event(_INTERNAL_ERROR.body())
        else:
            if call.include_usage:
                yield _event(render.chunk([], render.usage(usages)))
        yield DONE

    async def _messages(self, call: EngineCall, calls: StreamCalls
                        ) -> AsyncIterator[tuple[int, pb.GenerateStreamResponse]]:
        """The servicer's stream messages of every prompt, as they come, with the prompt's
        index; closing this ends (aborts) every stream still running."""
        # (Each stream closed in place, in aclosing: left to the garbage collector, its abort,
        # its count and the router's upstream cancel came later, in a task nobody awaits.)
        if len(call.requests) == 1:  # the common case, without a task per stream
            async with contextlib.aclosing(
                    self._stream(call.requests[0], call.field_names[0], calls)) as stream:
                async for message in stream:
                    yield 0, message
            return
        # A prompt's next message is taken once its last was handed on (taken[i]): each
        # stream waits for this response's writes as a single prompt's does, so a client that
        # stops reading holds its streams' output in the servicer (bounded there, merged) and
        # their calls open, ended with the response's stall; and the queue, one message a
        # prompt at most, serves them in turn. Unbounded, the streams ran to their end into it
        # whatever the client took, held it all here, and were counted OK.
        queue: asyncio.Queue = asyncio.Queue()
        taken = [asyncio.Event() for _ in call.requests]

        async def run(i: int) -> None:
            try:
                async with contextlib.aclosing(
                        self._stream(call.requests[i], call.field_names[i], calls)) as stream:
                    async for message in stream:
                        taken[i].clear()
                        queue.put_nowait((i, message))
                        await taken[i].wait()
                queue.put_nowait((i, None))
            except Exception as error:  # noqa: BLE001 - handed to the reader
                queue.put_nowait((i, error))

        tasks = [asyncio.ensure_future(run(i)) for i in range(len(call.requests))]
        try:
            running = len(tasks)
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
                    taken[i].set()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stream(self, wire: pb.GenerateRequest, field_names: dict[str, str],
                      calls: StreamCalls
                      ) -> AsyncIterator[pb.GenerateStreamResponse]:
        stream = self.servicer.GenerateStream(wire, calls.context())
        try:
            async with contextlib.aclosing(stream):
                async for message in stream:
                    yield message
        except CallAborted as aborted:
            raise from_status(aborted.code, aborted.details, field_names) from None

    # ---- the rest ---------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "pagedgen",
             "root": m.name, "max_model_len": m.max_model_len}
            for m in self.backend.models()]})

    async def health(self, request: Request) -> Response:
        serving = self.backend.serving()
        return JSONResponse({"status": "serving" if serving else "not serving"},
                            status_code=HTTPStatus.OK if serving
                            else HTTPStatus.SERVICE_UNAVAILABLE)

    async def tokenize(self, request: Request) -> Response:
        raw = await self._body(request)
        schemas.check_message_count(raw, MAX_CHAT_MESSAGES)
        body = schemas.parse(schemas.TokenizeRequest, raw)
        model = self._model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(HTTPStatus.BAD_REQUEST,
                           "give exactly one of prompt (text) or messages (chat), got "
                           f"{'both' if body.prompt is not None else 'neither'}", "prompt")
        _check_chat_fields_have_messages(body)
        if body.prompt is not None:
            wire, names = pb.TokenizeRequest(text=body.prompt), {"text": "prompt",
                                                                  "input": "prompt"}
        else:
            wire = pb.TokenizeRequest(chat=chat_messages(body.messages))
            wire.chat.tools_json = tools_json(body)
            wire.chat.template_kwargs_json = template_kwargs_json(body)
            set_chat_turn(wire.chat, body)
            names = {"chat.messages": "messages", "chat": "messages", "input": "messages",
                     "chat.tools_json": "tools",
                     "chat.template_kwargs_json": "chat_template_kwargs", **CHAT_TURN_NAMES}
        reply = await self._unary("Tokenize", wire, names, _caller(request))
        return JSONResponse({"count": len(reply.token_ids), "max_model_len": model.max_model_len,
                             "tokens": list(reply.token_ids)})

    async def detokenize(self, request: Request) -> Response:
        body = schemas.parse(schemas.DetokenizeRequest, await self._body(request))
        self._model(body.model)
        reply = await self._unary("Detokenize", pb.DetokenizeRequest(token_ids=body.tokens),
                                  {"token_ids": "tokens"}, _caller(request))
        return JSONResponse({"prompt": reply.text})

    async def pin_prefix(self, request: Request) -> Response:
        raw = await self._body(request)
        schemas.check_message_count(raw, MAX_CHAT_MESSAGES)
        body = schemas.parse(schemas.PinPrefixRequest, raw)
        model = self._model(body.model)
        given = [name for name in ("prompt", "messages", "tokens")
                 if getattr(body, name) is not None]
        if len(given) != 1:
            raise ApiError(HTTPStatus.BAD_REQUEST,
                           "give exactly one of prompt (text), messages (chat) or tokens, got "
                           f"{' and '.join(given) or 'none of them'}", "prompt")
        _check_chat_fields_have_messages(body)
        wire = pb.PinPrefixRequest(cache_salt=body.cache_salt or "", ttl_s=body.ttl_s,
                                   unpin=body.unpin)
        if body.prompt is not None:
            wire.text = body.prompt
        elif body.messages is not None:
            wire.chat.CopyFrom(chat_messages(body.messages))
            wire.chat.tools_json = tools_json(body)
            wire.chat.template_kwargs_json = template_kwargs_json(body)
            set_chat_turn(wire.chat, body)
        else:  # no prompt could use more of a prefix: counted before the ids are read
            check_token_count("tokens", body.tokens, model.prompt_context, for_output=False)
            wire.token_ids.ids.extend(body.tokens)
        names = {"text": "prompt", "token_ids": "tokens", "token_ids.ids": "tokens",
                 "chat.messages": "messages", "chat.tools_json": "tools",
                 "chat.template_kwargs_json": "chat_template_kwargs",
                 "chat": "messages", "input": given[0], "prompt": given[0], **CHAT_TURN_NAMES}
        reply = await self._unary("PinPrefix", wire, names, _caller(request))
        return JSONResponse({"num_blocks": reply.num_blocks, "num_pinned": reply.num_pinned})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": _version()})


def _caller(request: Request):
    """Who sent the request (tenancy/gate.py's Caller), as the key check found it."""
    return request.scope.get(CALLER_SCOPE_KEY)


async def _body(request: Request, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The request's body, refused with a 413 as soon as it is known to pass MAX_BODY_BYTES
    (by its Content-Length, else by what has arrived), before it is held whole; with a 408
    when no byte of it arrives for `timeout_s` (from its head, then from each part), or when
    past its first `timeout_s` it falls below BODY_MIN_BYTES_PER_S on average."""
    limit = schemas.MAX_BODY_BYTES
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"got {declared}")
    chunks, size = [], 0
    stream = request.stream()
    loop = asyncio.get_running_loop()
    started = loop.time()
    ceiling = started + timeout_s  # the pace's bound: grows with each byte that arrives
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            async for chunk in stream:
                size += len(chunk)
                if size > limit:
                    break
                chunks.append(chunk)
                ceiling = started + timeout_s + size / BODY_MIN_BYTES_PER_S
                deadline.reschedule(min(loop.time() + timeout_s, ceiling))
    except TimeoutError:
        of = f" of {declared}" if declared.isdigit() else ""
        elapsed = loop.time() - started
        if len(chunks) <= 1:  # nothing came after what came with the head
            message = (f"the request body must arrive within {timeout_s:g} s of its head, "
                       f"got {size} bytes{of} by then")
        elif loop.time() >= ceiling:
            message = (f"the request body must arrive at {BODY_MIN_BYTES_PER_S} bytes/s or "
                       f"more past its first {timeout_s:g} s, got {size} bytes{of} in "
                       f"{elapsed:.0f} s")
        else:
            message = (f"the request body stopped arriving: no byte for {timeout_s:g} s, "
                       f"after {size} bytes{of} in {elapsed:.0f} s")
        raise ApiError(HTTPStatus.REQUEST_TIMEOUT, message, code="request_timeout") from None
    if size > limit:
        await _drain(stream)
        raise _too_large("got more")
    return b"".join(chunks)


# What a refused body may still send before its 413 goes out: a server that closes a
# connection with data unread resets it (TCP RST), and the client, still sending, may lose the
# 413 with the reset and see only a dropped connection (issue seen in the suite: 1 run in 3).
# Past these bounds the client is not waiting for an answer, and the connection is closed.
DRAIN_MAX_BYTES = 8 << 20
DRAIN_MAX_S = 2.0


async def _drain(stream: AsyncIterator[bytes]) -> None:
    """Reads and drops the rest of a refused body, within DRAIN_MAX_BYTES and DRAIN_MAX_S."""
    drained = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_MAX_S):
            async for chunk in stream:
                drained += len(chunk)
                if drained > DRAIN_MAX_BYTES:
                    return


def _check_chat_fields_have_messages(body: schemas.TokenizeRequest | schemas.PinPrefixRequest
                                     ) -> None:
    """tools, chat_template_kwargs and continue_final_message go to the chat template: a 400
    without messages."""
    for field in ("tools", "chat_template_kwargs", "continue_final_message"):
        if getattr(body, field) and body.messages is None:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"{field} must be left unset without "
                           f"messages (the chat template is what takes them), got {field}",
                           field)


def _too_large(got: str) -> ApiError:
    return ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"the request body must be at most {schemas.MAX_BODY_BYTES} bytes, {got}: "
                    "send fewer or shorter prompts")


def _version() -> str:
    try:
        return metadata.version("pagedgen")
    except metadata.PackageNotFoundError:
        return "unknown"


async def _all_or_none(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Every call's result; when one fails, the others are cancelled (their requests aborted)
    before the error is raised: asyncio.gather would leave them generating for nobody."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


# How a stream still running when the server stops (its drain's grace is over) ends.
SHUTTING_DOWN = _event(_STOPPED.body()) + DONE


async def _prepend(first: bytes, rest: AsyncGenerator[bytes, None]
                   ) -> AsyncGenerator[bytes, None]:
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()
