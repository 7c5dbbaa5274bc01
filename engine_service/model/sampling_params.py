"""Per-request sampling parameters, mirroring vLLM's `SamplingParams` (offline API and gRPC)."""

import math
from dataclasses import dataclass, field

from engine_service.model.bad_words import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    bad_words_token_ids,
)
from engine_service.model.structured_outputs import StructuredOutputsParams

MAX_N = 64  # parallel samples per request: each one holds its own KV blocks once it diverges
MAX_BEAM_WIDTH = 64  # beams per request (an engine may allow fewer: see LLMEngine.validate_request)
EARLY_STOPPING_CHOICES = (False, True, "never")  # HF's `early_stopping` values
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # the detokenizer holds back (longest stop - 1) chars per step
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # entries of logit_bias: each is a scatter into its row every step
# allowed_token_ids' entries: a whole vocabulary of the largest (Gemma's 262,144); the wire's
# message limit grows by them (serving/connection_limits.py).
MAX_ALLOWED_TOKEN_IDS = 262_144
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias is in [-100, 100]
MIN_SEED = -(2**63)  # the range torch.Generator.manual_seed accepts
MAX_SEED = 2**64 - 1
# Temperatures below this are greedy: dividing logits by ~0 only overflows (vLLM does the same).
GREEDY_TEMPERATURE_EPS = 1e-5


class ModelFieldError(ValueError):
    """A field whose value does not fit the model (check_for_model): the field's name kept."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _check_int(name: str, value: object, allowed: str) -> int:
    # bool is a subclass of int, but `n=True` is always a caller's bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int ({allowed}), got {value!r}")
    return value


def _check_float(name: str, value: object, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number ({allowed}), got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number ({allowed}), got {value!r}")
    return value


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")


@dataclass(slots=True)
class SamplingParams:
    """What to sample and when to stop; validated on construction (ValueError names the field).

    Greedy decoding is `temperature == 0` (anything below 1e-5): top_k/top_p/min_p are then
    ignored. `top_k == 1` is not special-cased as greedy here; it gives the same token as
    greedy anyway, but still consumes the request's random generator like any sampled row.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: until the context window is full
    min_tokens: int = 0
    stop: str | list[str] | None = None  # normalized to a list
    stop_token_ids: list[int] | None = None  # normalized to a list
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per output token; 0: the sampled token's only
    # top-k logprobs per prompt token (each with the prompt token's own); 0: its own only. The
    # prompt is then computed whole, its cached blocks not read: a cached block has no logits.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Beam search (HF's semantics) when beam_width is set: the n best of beam_width beams are
    # returned, only once the search is over. Needs temperature 0.
    beam_width: int | None = None
    length_penalty: float = 1.0  # finished beams score cum_logprob / length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never", as in HF transformers
    # token id -> a number added to its logit before penalties and sampling (OpenAI's
    # logit_bias, in [-100, 100]); logprobs stay the model's own. Normalized to a dict.
    logit_bias: dict[int, float] | None = None
    # The output must match this (a JSON Schema, a regex, a choice, a grammar): each step's
    # logits are masked to the tokens that keep it inside (model/grammar.py). A dict is taken
    # as its fields.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: the only tokens the output may hold (every other logit masked to -inf), ids <
    # the model's vocabulary. Normalized to a sorted tuple without repeats.
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: the prompt cut to its last this-many tokens before it runs (left truncation);
    # -1: to the longest prompt the engine takes (its context, and its KV pool, less one token
    # for the output). None: not cut.
    truncate_prompt_tokens: int | None = None
    # vLLM's: words the output must not write (model/bad_words.py), at most 128 of up to 256
    # characters; normalized to a tuple. Their token ids are made by the tokenizer's side
    # (tokenize_bad_words); an engine without a tokenizer refuses them.
    bad_words: tuple[str, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    # (which tokenizer and words bad_words_token_ids were made from: remade when either
    # changes, as an offline caller may reuse the object)
    _bad_words_source: tuple | None = field(default=None, init=False, repr=False,
                                            compare=False)

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check (and normalize) every field; ValueError names the first bad one. Run again by
        LLM.generate: a field assigned after construction (`params.max_tokens = 0`) skips
        __post_init__, and the engine trusts what it is given."""
        n = _check_int("n", self.n, f"1 to {MAX_N}")
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {n}")

        self.temperature = _check_float("temperature", self.temperature, ">= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p, "in (0, 1]")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        top_k = _check_int("top_k", self.top_k, "-1 or 0 for off, or >= 1")
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {top_k}")
        self.min_p = _check_float("min_p", self.min_p, "in [0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        if self.seed is not None:
            seed = _check_int("seed", self.seed, f"in [{MIN_SEED}, {MAX_SEED}] or None")
            if not MIN_SEED <= seed <= MAX_SEED:
                raise ValueError(f"seed must be in [{MIN_SEED}, {MAX_SEED}], got {seed}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name), "in [-2, 2]")
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty, "> 0")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
            )

        if self.max_tokens is not None:
            max_tokens = _check_int("max_tokens", self.max_tokens, ">= 1 or None")
            if max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
        min_tokens = _check_int("min_tokens", self.min_tokens, ">= 0")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        if self.max_tokens is not None and min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {min_tokens}"
            )

        self.stop = self._normalized_stop(self.stop)
        self.stop_token_ids = self._normalized_stop_token_ids(self.stop_token_ids)

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                value = _check_int(name, value, f"0 to {MAX_LOGPROBS} or None")
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}")
        self.logit_bias = self._normalized_logit_bias(self.logit_bias)
        self.allowed_token_ids = self._normalized_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = self._normalized_bad_words(self.bad_words)
        self.bad_words_token_ids = self._normalized_word_ids(self.bad_words_token_ids)
        if (self.bad_words or self.bad_words_token_ids) and self.allowed_token_ids is not None:
            # Both leave tokens out: together they could leave a step none.
            raise ValueError("bad_words must be left unset with allowed_token_ids (leave "
                             "those tokens out of allowed_token_ids), got "
                             f"{self._num_bad_words()}")
        if self.truncate_prompt_tokens is not None:
            keep = _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens,
                              ">= 1, -1 for the longest prompt the engine runs, or None")
            if keep < 1 and keep != -1:
                raise ValueError(f"truncate_prompt_tokens must be >= 1, -1 (the longest prompt "
                                 f"the engine runs) or None, got {keep}")
        self._check_structured_outputs()
        self._check_beam_search()

    def _check_structured_outputs(self) -> None:
        spec = self.structured_outputs
        if spec is None:
            return
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - set(StructuredOutputsParams.__slots__))
            if unknown:
                raise ValueError(f"structured_outputs must have only the fields "
                                 f"{', '.join(StructuredOutputsParams.__slots__)}, got "
                                 f"{', '.join(map(repr, unknown))}")
            spec = self.structured_outputs = StructuredOutputsParams(**spec)
        if not isinstance(spec, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, a dict "
                             f"or None, got {type(spec).__name__}")
        if self.bad_words or self.bad_words_token_ids:
            raise ValueError(f"bad_words must be left unset with structured_outputs (the "
                             f"constraint says which tokens may come), got "
                             f"{self._num_bad_words()}")
        if self.allowed_token_ids is not None:
            # Two masks that need not meet: a step could be left with no token at all.
            raise ValueError(f"allowed_token_ids must be left unset with structured_outputs "
                             f"(the constraint says which tokens may come), got "
                             f"{len(self.allowed_token_ids)} ids")
        if self.ignore_eos:
            # The grammar ends the output with EOS: ignoring it would run past the grammar.
            raise ValueError("ignore_eos must be False with structured_outputs (the output "
                             "ends where its grammar does, with EOS), got True")

    def _check_beam_search(self) -> None:
        self.length_penalty = _check_float("length_penalty", self.length_penalty, "a number")
        # Compared by identity for the bools: 1 and 0 are no early_stopping values.
        if not any(self.early_stopping is c or (isinstance(c, str) and self.early_stopping == c)
                   for c in EARLY_STOPPING_CHOICES):
            raise ValueError(
                f"early_stopping must be one of True, False or 'never', got {self.early_stopping!r}"
            )
        if self.beam_width is None:
            if self.length_penalty != 1.0 or self.early_stopping is not False:
                raise ValueError(
                    "length_penalty and early_stopping must be left at 1.0 and False unless "
                    f"beam_width is set (they only steer beam search), got length_penalty="
                    f"{self.length_penalty}, early_stopping={self.early_stopping!r}"
                )
            return
        width = _check_int("beam_width", self.beam_width, f"1 to {MAX_BEAM_WIDTH} or None")
        if not 1 <= width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be between 1 and {MAX_BEAM_WIDTH}, got {width}")
        # Beam search scores the model's raw log-probabilities: nothing may reshape them.
        if not self.is_greedy:
            raise ValueError(
                f"temperature must be 0 with beam search (beam_width set), got {self.temperature}"
            )
        if self.n > width:
            raise ValueError(
                f"n must be at most beam_width ({width}) with beam search (the n best beams "
                f"are returned), got {self.n}"
            )
        refused = {
            "stop": self.stop,
            "logprobs": self.logprobs is not None,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "repetition_penalty": self.repetition_penalty != 1,
            "logit_bias": bool(self.logit_bias),
            "structured_outputs": self.structured_outputs is not None,
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words or self.bad_words_token_ids),
        }
        for name, is_set in refused.items():
            if is_set:
                value = getattr(self, name)
                # A map or a schema may be long: its size or its kind says enough.
                shown = (self._num_bad_words() if name == "bad_words"
                         else f"{len(value)} entries"
                         if name in ("logit_bias", "allowed_token_ids")
                         else f"a {value.kind} constraint" if name == "structured_outputs"
                         else repr(value))
                hint = " (use stop_token_ids to stop)" if name == "stop" else ""
                raise ValueError(
                    f"{name} must be left unset with beam search (beam_width set): not "
                    f"supported there{hint}, got {shown}"
                )

    @staticmethod
    def _normalized_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list | tuple):
            raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop must hold strings of at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {len(s)}"
                )
        return list(stop)

    @staticmethod
    def _normalized_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of ints or None, got {ids!r}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
            )
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {i!r}")
        return list(ids)

    @staticmethod
    def _normalized_logit_bias(bias: object) -> dict[int, float]:
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias or None, "
                             f"got {bias!r}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries, "
                             f"got {len(bias)}")
        allowed = f"in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"
        normalized = {}
        for token_id, value in bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias must map non-negative token ids to biases, "
                                 f"got the key {token_id!r}")
            value = _check_float(f"logit_bias[{token_id}]", value, allowed)
            if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias[{token_id}] must be {allowed}, got {value!r}")
            normalized[token_id] = value
        return normalized

    @staticmethod
    def _normalized_allowed_token_ids(ids: object) -> tuple[int, ...] | None:
        if ids is None:
            return None
        if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
            raise ValueError(f"allowed_token_ids must be a list of token ids or None, "
                             f"got {ids!r}")
        ids = list(ids)
        if not ids:
            raise ValueError("allowed_token_ids must hold at least one token id (None: any "
                             "token), got []")
        if len(ids) > MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"allowed_token_ids must hold at most {MAX_ALLOWED_TOKEN_IDS} ids, "
                             f"got {len(ids)}")
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"allowed_token_ids must be non-negative ints, got {i!r}")
        return tuple(sorted(set(ids)))

    @staticmethod
    def _normalized_bad_words(words: object) -> tuple[str, ...] | None:
        if words is None:
            return None
        if isinstance(words, str) or not isinstance(words, list | tuple):
            raise ValueError(f"bad_words must be a list of strings or None, got {words!r}")
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words must hold at most {MAX_BAD_WORDS} words, "
                             f"got {len(words)}")
        for word in words:
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must hold strings with a non-space character, "
                                 f"got {word!r}")
            if len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad_words must hold words of at most {MAX_BAD_WORD_CHARS} "
                                 f"characters, got one of {len(word)}")
        return tuple(words) or None

    @staticmethod
    def _normalized_word_ids(words: object) -> tuple[tuple[int, ...], ...] | None:
        if words is None:
            return None
        if not isinstance(words, list | tuple) or len(words) > 2 * MAX_BAD_WORDS or not all(
                isinstance(w, list | tuple) and 0 < len(w) <= MAX_BAD_WORD_TOKENS and all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in w)
                for w in words):
            raise ValueError(f"bad_words_token_ids must be at most {2 * MAX_BAD_WORDS} lists "
                             f"of 1 to {MAX_BAD_WORD_TOKENS} token ids, got {str(words)[:80]}")
        return tuple(tuple(w) for w in words)

    def only_stops_allowed(self, eos_token_ids: frozenset[int] | set[int]) -> bool:
        """Whether every token allowed_token_ids allows would stop the output (EOS, unless
        ignored, and stop_token_ids)."""
        if self.allowed_token_ids is None:
            return False
        stops = set(self.stop_token_ids)
        if not self.ignore_eos:
            stops |= eos_token_ids
        return stops.issuperset(self.allowed_token_ids)

    def tokenize_bad_words(self, tokenizer) -> None:
        """bad_words_token_ids made from bad_words with the model's tokenizer, again whenever
        either changed (bad_words win over ids given beside them). ValueError naming
        bad_words for a word of too many tokens."""
        if not self.bad_words:
            return
        # (the tokenizer by what it is, not by id(): a freed one's id is reused)
        source = (getattr(tokenizer, "name_or_path", None), len(tokenizer), self.bad_words)
        if source != self._bad_words_source:
            self.bad_words_token_ids = bad_words_token_ids(tokenizer, self.bad_words)
            self._bad_words_source = source

    def _num_bad_words(self) -> str:
        count = len(self.bad_words or self.bad_words_token_ids or ())
        return f"{count} word{'s' if count != 1 else ''}"

    def prompt_tokens_kept(self, num_prompt_tokens: int, longest_prompt: int) -> int:
        """How many of a prompt's tokens run (its last ones): truncate_prompt_tokens';
        `longest_prompt`: the most that let the request run (-1's: request_limits.py)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return num_prompt_tokens
        if keep == -1:
            keep = longest_prompt
        return min(num_prompt_tokens, keep)

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width is not None

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs at once: its beams, or its n samples."""
        return self.beam_width if self.beam_width is not None else self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    def check_for_model(self, vocab_size: int) -> None:
        """Checks the ids that only make sense against a model's vocabulary (ModelFieldError
        names the field)."""
        for i in self.stop_token_ids:
            if i >= vocab_size:
                raise ModelFieldError(
                    "stop_token_ids",
                    f"stop_token_ids must be < the model's vocab size {vocab_size}, got {i}"
                )
        if self.allowed_token_ids is not None and self.allowed_token_ids[-1] >= vocab_size:
            raise ModelFieldError(
                "allowed_token_ids", f"allowed_token_ids must be < the model's vocab size "
                f"{vocab_size}, got {self.allowed_token_ids[-1]}")
        for word in self.bad_words_token_ids or ():
            if max(word) >= vocab_size:
                raise ModelFieldError(
                    "bad_words", f"bad_words must tokenize to ids < the model's vocab size "
                    f"{vocab_size}, got {max(word)}")
        for i in self.logit_bias:
            if i >= vocab_size:
                raise ModelFieldError("logit_bias",
                    f"logit_bias must map token ids < the model's vocab size {vocab_size}, "
                    f"got the key {i}"
                )
