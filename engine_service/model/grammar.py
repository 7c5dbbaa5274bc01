"""Structured outputs on xgrammar: a request's constraint compiled once for the model's
tokenizer, a matcher per sequence that follows its tokens, and the bitmask of the tokens each
step may take.

xgrammar is imported on the first constrained request. Compiled grammars are cached by
xgrammar (same constraint, same grammar). The offline engine compiles here, on its own thread;
a serving core compiles in a process of its own (serving/grammar_worker.py, which loads the
tokenizer; serving/grammar_process.py), so that a compilation can be stopped.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable

from engine_service.core.errors import InvalidRequestError
from engine_service.model.config import ModelConfig
from engine_service.model.structured_outputs import StructuredOutputsParams
from engine_service.model.tokenizer import load_tokenizer

# Compiled grammars kept (xgrammar's cache, in bytes): a JSON schema's is tens of KiB to MiBs.
GRAMMAR_CACHE_BYTES = 256 << 20
# xgrammar's errors start with a timestamp and the C++ source line, and some with the check
# that failed: neither tells the caller anything.
_NOISE = re.compile(r"^\[[0-9:]+\] [^ ]+:\d+: (Check failed: .*? is false: )?")


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one model. compile() may run on any one thread at
    a time; the matchers it makes belong to the engine's thread."""

    def __init__(self, model_config: ModelConfig, vocab_size: int,
                 eos_token_ids: Iterable[int], tokenizer: Callable[[], object] | None = None
                 ) -> None:
        self.model_config = model_config
        # The engine's own tokenizer when it has one loaded (else loaded here, once).
        self._tokenizer = tokenizer or (lambda: load_tokenizer(model_config))
        self.vocab_size = vocab_size
        # The grammar ends on these: the engine's EOS set, so the end of the grammar is the
        # end of the sequence.
        self.stop_token_ids = sorted(eos_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar (xgrammar.CompiledGrammar); InvalidRequestError naming
        structured_outputs (and the kind, in its message) when it does not compile."""
        with self._lock:
            compiler = self._compiler or self._make_compiler()
            try:
                return compile_spec(compiler, spec)
            except RuntimeError as error:  # xgrammar's parse and conversion errors
                raise compile_error(spec, str(error)) from None

    def _make_compiler(self):
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            self._tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        self._compiler = new_compiler(info)
        return self._compiler


def tokenizer_info(model_config: ModelConfig, vocab_size: int, stop_token_ids: list[int]):
    """The model's vocabulary as xgrammar sees it (xgrammar.TokenizerInfo)."""
    import xgrammar

    return xgrammar.TokenizerInfo.from_huggingface(
        load_tokenizer(model_config), vocab_size=vocab_size, stop_token_ids=stop_token_ids)


def new_compiler(info, cache: bool = True):
    """cache=False where the caller keeps the compiled grammars (the serving core does)."""
    import xgrammar

    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=cache,
                                    cache_limit_bytes=GRAMMAR_CACHE_BYTES)


def compile_error(spec: StructuredOutputsParams, reason: str) -> InvalidRequestError:
    """The caller's error for a constraint xgrammar refused with `reason`."""
    kind = spec.kind
    reason = _NOISE.sub("", reason.strip()).splitlines()[0] if reason.strip() else "no reason"
    return InvalidRequestError(
        "structured_outputs", f"structured_outputs.{kind} must be a valid {_WHAT[kind]}, got "
        f"one that does not compile: {reason}")


_WHAT = {"json": "JSON Schema", "json_object": "JSON object", "regex": "regular expression",
         "choice": "list of choices", "grammar": "EBNF grammar"}


def compile_spec(compiler, spec: StructuredOutputsParams):
    kind = spec.kind
    if kind == "json":
        # Compact JSON (', ' and ': ' between items, no other whitespace): a model free to add
        # whitespace can fill max_tokens with it (vLLM's disable_any_whitespace).
        return compiler.compile_json_schema(spec.json, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(spec.choice))
    return compiler.compile_grammar(spec.grammar)


def choice_grammar(choices: Iterable[str]) -> str:
    """EBNF whose language is exactly these strings."""
    return "root ::= " + " | ".join(_ebnf_string(c) for c in choices)


def _ebnf_string(text: str) -> str:
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\x{ord(char):02x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def follow_resumed_tokens(matcher, token_ids: list[int]) -> None:
    """Advances a new matcher past output a request resumes from (InvalidRequestError when
    the grammar does not allow it, or ends inside it)."""
    for position, token in enumerate(token_ids):
        if not matcher.accept_token(token) or matcher.is_terminated():
            raise InvalidRequestError(
                "structured_outputs", f"structured_outputs.resumed_tokens must count output "
                f"its constraint allows, unfinished; got token {token} at resumed position "
                f"{position}, which it {'ends on' if matcher.is_terminated() else 'refuses'}")


def new_matcher(compiled):
    """A matcher at the start of the grammar (one per sequence)."""
    import xgrammar

    return xgrammar.GrammarMatcher(compiled)
