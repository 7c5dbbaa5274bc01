"""The raw UTF-8 bytes of tokens (OpenAI's logprobs `bytes`), which a token's decoded text
cannot give: a token holding part of a character decodes to U+FFFD alone, so bytes taken from
its text could not rebuild the character from its tokens."""

from __future__ import annotations

import json
import re
from collections.abc import Callable


def _gpt2_byte_table() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode, shared by the Llama 3, Qwen and
    SmolLM tokenizers): each byte as a printable character; this maps them back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _gpt2_byte_table()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
_SPACE_PIECE = "\u2581"  # SentencePiece's space marker


def _decodes_byte_level(tokenizer) -> bool:
    """Whether a fast tokenizer's decoder is byte-level BPE's, alone or in a sequence."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    found, todo = False, [json.loads(backend.to_str()).get("decoder")]
    while todo and not found:
        node = todo.pop()
        if isinstance(node, dict):
            found = node.get("type") == "ByteLevel"
            todo.extend(node.get("decoders") or ())
    return found


def token_bytes(tokenizer) -> Callable[[list[int]], list[bytes]]:
    """A function from token ids to their bytes, for a Hugging Face tokenizer: special tokens
    as their text, SentencePiece byte pieces (<0xE6>) as their byte, byte-level BPE pieces
    through the byte table; any other token as its decoded text (whole characters)."""
    byte_level = _decodes_byte_level(tokenizer)
    special = set(getattr(tokenizer, "added_tokens_decoder", {}))

    def one(token_id: int, piece: str | None) -> bytes:
        if piece is not None:
            if token_id in special:
                return piece.encode()
            if byte := _BYTE_PIECE.fullmatch(piece):
                return bytes([int(byte[1], 16)])
            if byte_level and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            if not byte_level and _SPACE_PIECE in piece:
                # SentencePiece's word start: its space, which decoding one token strips.
                return piece.replace(_SPACE_PIECE, " ").encode()
        return tokenizer.decode([token_id]).encode()

    def of(token_ids: list[int]) -> list[bytes]:
        pieces = tokenizer.convert_ids_to_tokens(token_ids)
        return [one(t, p) for t, p in zip(token_ids, pieces, strict=True)]

    return of
