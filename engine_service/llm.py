"""The offline API, mirroring vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""

import contextlib
import dataclasses
import itertools
import numbers
import signal
import threading
from collections.abc import Callable, Iterator, Sequence

from tqdm import tqdm

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.core.errors import InvalidRequestError
from engine_service.core.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from engine_service.core.request_limits import truncated_prompt
from engine_service.model.beam_search_params import BeamSearchParams
from engine_service.model.sampling_params import SamplingParams
from engine_service.model.tokenizer import (
    FinalMessageError,
    chat_turn_error,
    render_chat,
    template_kwargs_error,
)

Prompt = str | dict
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
ENGINE_ARGS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model")


@contextlib.contextmanager
def _interrupts_between_steps() -> Iterator[Callable[[], None]]:
    """Ctrl-C while generating is taken between engine steps (the yielded check raises it), not
    inside one: a step cut short under tensor parallelism leaves the workers in a collective
    rank 0 never finishes, and the next call hung until gloo's timeout. A second Ctrl-C during
    the same step raises at once. Only in the main thread, and only over Python's default
    handler: a program's own SIGINT handler is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield lambda: None
        return
    pending = []

    def defer(signum, frame) -> None:
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)

    def check() -> None:
        if pending:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, defer)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class LLM:
    """Offline batch generation. `model` is a local HF directory or GGUF file; None means the
    default model (SmolLM2-135M-Instruct, prepared into the cache by pagedgen-prepare-model)."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        unknown = sorted(set(engine_args) - set(ENGINE_ARGS))
        if unknown:
            # EngineConfig's own TypeError named neither LLM nor what it does take.
            raise TypeError(f"LLM() got unknown keyword argument(s) {', '.join(unknown)}; the "
                            f"engine settings are: {', '.join(ENGINE_ARGS)}")
        self._closed = False
        if model is None:
            from engine_service.tools.prepare_model import ensure_default_model

            model = str(ensure_default_model())
        self.llm_engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self._request_ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (tensor_parallel_size > 1; otherwise
        nothing to do). They also stop when this object is collected or the process exits.
        Idempotent; generating afterwards raises RuntimeError."""
        self._closed = True
        self.llm_engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        # Without it, a closed tensor-parallel LLM failed on its stopped workers ("rank 1
        # exited with status 0"), and a one-rank one went on working: neither says "closed".
        if self._closed:
            raise RuntimeError("this LLM is closed (close() or the end of its with block): "
                               "make a new LLM to generate")

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def _need_tokenizer(self, what: str):
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError(
                "prompt", f"prompt must be token ids ({{'prompt_token_ids': [...]}}) when the "
                f"engine has no tokenizer (skip_tokenizer_init=True), got {what}"
            )
        return tokenizer

    def _token_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            self._check_prompt_dict(prompt)
        if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in
                                       prompt and "prompt" in prompt):
            self._need_tokenizer("text")
        if isinstance(prompt, str):
            return self.llm_engine.tokenizer.encode(prompt), prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"]), prompt.get("prompt")
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.llm_engine.tokenizer.encode(prompt["prompt"]), prompt["prompt"]
        raise ValueError(
            "prompt must be a string, {'prompt': str} or {'prompt_token_ids': "
            f"[int, ...]}}, got {type(prompt).__name__}: {str(prompt)[:80]!r}"
        )

    @staticmethod
    def _check_prompt_dict(prompt: dict) -> None:
        # An unknown key was ignored: a misspelt "cache_salt" silently shared the cache.
        unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
        if unknown:
            raise InvalidRequestError(
                "prompt", f"a prompt dict takes the keys {', '.join(PROMPT_KEYS)}, got "
                f"{', '.join(map(repr, unknown))}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise InvalidRequestError("prompt", f"prompt['prompt'] must be a string, got "
                                      f"{type(text).__name__}: {str(text)[:80]!r}")
        ids = prompt.get("prompt_token_ids")
        if ids is not None and not isinstance(ids, list | tuple | range):
            raise InvalidRequestError(
                "prompt_token_ids", f"prompt_token_ids must be a list of ints, got "
                f"{type(ids).__name__}: {str(ids)[:80]!r}")
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequestError("cache_salt", f"cache_salt must be a string or None, got "
                                      f"{salt!r}")

    @staticmethod
    def _sampling_params_list(sampling_params: object, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * num_prompts
        if not isinstance(sampling_params, list | tuple) or not all(
                isinstance(p, SamplingParams) for p in sampling_params):
            raise InvalidRequestError(
                "sampling_params", "sampling_params must be a SamplingParams, a list of them "
                f"(one per prompt) or None, got {str(sampling_params)[:80]!r}")
        if len(sampling_params) != num_prompts:
            raise InvalidRequestError(
                "sampling_params", f"sampling_params must be one or one per prompt "
                f"({num_prompts}), got {len(sampling_params)}")
        # Checked again: a field assigned since construction skipped the checks (n = 0 ran
        # 16 tokens, stop = "ab" stopped on "a" or "b").
        for params in {id(p): p for p in sampling_params}.values():
            params.verify()
        return list(sampling_params)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise ValueError(
                "prompt must be a string, a dict or a list of them, "
                f"got {type(prompts).__name__}: {str(prompts)[:80]!r}"
            )
        self._check_open()
        prompts = list(prompts)
        sampling_params = self._sampling_params_list(sampling_params, len(prompts))
        if priority is not None and (
                not isinstance(priority, list | tuple)
                or not all(isinstance(p, numbers.Integral) and not isinstance(p, bool)
                           for p in priority)):
            raise InvalidRequestError("priority", f"priority must be a list of ints (one per "
                                      f"prompt) or None, got {str(priority)[:80]!r}")
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequestError(
                "priority",
                f"priority must have one entry per prompt ({len(prompts)}), got {len(priority)}"
            )
        engine = self.llm_engine
        # Validate everything before submitting anything: a bad prompt leaves nothing behind.
        requests = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
            token_ids, text = self._token_ids(prompt)
            token_ids = truncated_prompt(token_ids, params, engine.limits)
            if params.bad_words and engine.tokenizer is not None:
                try:
                    params.tokenize_bad_words(engine.tokenizer)
                except ValueError as error:
                    raise InvalidRequestError("bad_words", str(error)) from None
            engine.validate_request(token_ids, params)
            salt = prompt.get("cache_salt", cache_salt) if isinstance(prompt, dict) else cache_salt
            requests.append(
                (
                    str(next(self._request_ids)),
                    token_ids,
                    params,
                    text,
                    salt,
                    priority[i] if priority is not None else 0,
                )
            )
        order = {}
        results: list[RequestOutput | None] = [None] * len(requests)
        # No bar at all unless asked: even a disabled tqdm starts its monitor thread, which
        # then outlives the call.
        bar = tqdm(total=len(requests), desc="generate") if use_tqdm else None
        try:
            # Added inside the try: a request added before an interrupt is aborted with the
            # rest, not left to run in (and break) the next call.
            # Noted before it is added (aborting one never added is a no-op): an interrupt
            # inside add_request, after the engine queued it, must abort it too.
            for index, (request_id, token_ids, params, text, salt, prio) in enumerate(requests):
                order[request_id] = index
                # Only the final outputs are read here: the engine makes no output per step.
                engine.add_request(request_id, token_ids, params, prompt=text, cache_salt=salt,
                                   priority=prio, final_output_only=True)
            with _interrupts_between_steps() as check_interrupt:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            results[order[output.request_id]] = output
                            if bar is not None:
                                bar.update(1)
                    check_interrupt()
                check_interrupt()  # (one that came in as the last step ended is not lost)
        except BaseException:
            for request_id in order:
                engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return results

    def pin_prefix(self, prompt: Prompt, ttl_s: float = 0.0, unpin: bool = False,
                   cache_salt: str | None = None) -> int:
        """Keeps the full blocks of `prompt` cached however full the pool gets, computing them
        first when they are not cached (a prefill-only request): later prompts that start
        with it find them cached. The pin lasts ttl_s seconds (0: until unpinned; pinned
        again, the later expiry holds); pins share blocks, and a block stays pinned while
        any pin covers it. Pinned blocks count against the pin budget (what the pool spares
        beside the running requests, within --pin-budget-floor/--pin-budget-ceiling; the
        prefill here is not counted, it computes the pin's own blocks): PinBudgetFull past
        it, before anything is computed. unpin=True drops this prompt's
        pin. Returns how many blocks the pin covers (or, unpinning, how many blocks no pin
        holds any more)."""
        from engine_service.serving.validation import MAX_TTL_S

        self._check_open()
        engine = self.llm_engine
        if not isinstance(unpin, bool):
            raise InvalidRequestError("unpin", f"unpin must be True or False, got {unpin!r}")
        if (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float))
                or not 0 <= ttl_s <= MAX_TTL_S):
            raise InvalidRequestError("ttl_s", f"ttl_s must be a number of seconds in [0, "
                                      f"{MAX_TTL_S:.0f}] (0: until unpinned), got {ttl_s!r}")
        token_ids, _ = self._token_ids(prompt)
        salt = cache_salt
        if isinstance(prompt, dict) and "cache_salt" in prompt:
            if cache_salt is not None and prompt["cache_salt"] != cache_salt:
                raise InvalidRequestError(
                    "cache_salt", f"cache_salt is given twice, {prompt['cache_salt']!r} in the "
                    f"prompt and {cache_salt!r} as an argument: give one")
            salt = prompt["cache_salt"]
        if not engine.kv.enable_prefix_caching:
            raise InvalidRequestError("prompt", "pin_prefix needs the prefix cache, and this "
                                      "engine runs without it (enable_prefix_caching=False)")
        chain = engine.hasher.chain(token_ids, salt)
        if not chain:
            raise InvalidRequestError(
                "prompt", f"prompt must hold at least one full block ({engine.config.block_size} "
                f"tokens) to pin, got {len(token_ids)} tokens")
        policy = engine.pool.policy
        if not hasattr(policy, "pin"):
            raise InvalidRequestError("prompt", "this engine's prefix policy takes no pins")
        if not unpin:
            policy.check_pin(chain)  # refused before any prefill
            self._prefill_for_pin(token_ids, salt)
        return policy.pin(chain, float(ttl_s), unpin, engine.pool.is_cached)

    def _prefill_for_pin(self, token_ids: list[int], salt: str | None) -> None:
        """Computes the prompt's blocks (one token sampled and dropped) as a pin's prefill,
        which the pin budget does not count as demand (it is the pin's own blocks)."""
        engine = self.llm_engine
        request_id = str(next(self._request_ids))
        engine.add_request(request_id, token_ids, SamplingParams(temperature=0.0, max_tokens=1),
                           cache_salt=salt, final_output_only=True, pin_prefill=True)
        try:
            with _interrupts_between_steps() as check_interrupt:
                while engine.has_unfinished_requests():
                    engine.step()
                    check_interrupt()
        except BaseException:
            engine.abort_request(request_id)
            raise

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (all in one continuous batch); per prompt, the best
        beams, best first, each with its generated token ids, text and cumulative logprob."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(
                f"params must be a BeamSearchParams, got {type(params).__name__}"
            )
        outputs = self.generate(
            prompts, params.sampling_params(), use_tqdm=use_tqdm, cache_salt=cache_salt
        )
        return [
            BeamSearchOutput(
                sequences=[
                    BeamSearchSequence(
                        token_ids=c.token_ids,
                        text=c.text,
                        cum_logprob=c.cumulative_logprob,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                    for c in out.outputs
                ],
                prompt_token_ids=out.prompt_token_ids,
                prompt=out.prompt,
            )
            for out in outputs
        ]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        **kwargs,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them; `tools`
        (OpenAI's tool objects) go to the template as the tools the model may call;
        `chat_template_kwargs` are more variables for it (e.g. {"enable_thinking": False} for
        Qwen3's), as vLLM's LLM.chat takes them. `continue_final_message`: the model continues
        the last message (e.g. an assistant's reply begun for it) instead of a new assistant's
        turn opening after it (`add_generation_prompt`; None: true unless continuing)."""
        error = chat_turn_error(add_generation_prompt, continue_final_message)
        if error is not None:
            raise InvalidRequestError("continue_final_message", error)
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        if chat_template_kwargs is not None:
            error = template_kwargs_error(chat_template_kwargs, "chat_template_kwargs")
            if error is not None:
                raise InvalidRequestError("chat_template_kwargs", error)
        if not isinstance(messages, list | tuple):
            raise InvalidRequestError("messages", "messages must be a list of {'role': ..., "
                                      "'content': ...} dicts (or a list of such lists), got "
                                      f"{type(messages).__name__}: {str(messages)[:80]!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        for conversation in conversations:
            # The template's own failure was a jinja UndefinedError naming no argument. (An
            # assistant's tool call may come without content.)
            if not isinstance(conversation, list | tuple) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and ("content" in m or "tool_calls" in m) for m in conversation):
                raise InvalidRequestError(
                    "messages", "messages must be a list of {'role': str, 'content': ...} "
                    f"dicts (or a list of such lists), got {str(conversation)[:80]!r}")
        tokenizer = self._need_tokenizer("chat messages")
        prompts = []
        for conversation in conversations:
            try:
                text = render_chat(tokenizer, list(conversation), tools, chat_template_kwargs,
                                   add_generation_prompt, continue_final_message)
            except FinalMessageError as error:
                raise InvalidRequestError("continue_final_message", str(error)) from None
            prompts.append(
                {
                    "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False),
                    "prompt": text,
                }
            )
        return self.generate(prompts, sampling_params, **kwargs)
