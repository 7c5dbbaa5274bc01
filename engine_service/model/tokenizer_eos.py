"""The tokenizer's end-of-sequence id, without loading it through transformers.

A serving core makes no text (the front does): it needs its tokenizer only for the EOS id that
ends generation beside config.json's. Loading one imports transformers, about 1 s of every
engine start. The id is where transformers finds it: the `eos_token` named by
tokenizer_config.json (or special_tokens_map.json), given its id by tokenizer.json as the
`tokenizers` library loads it (which numbers added tokens itself: the ids written in the file
are not always the ones it gives). Anything else (a GGUF file, no tokenizer.json, no EOS named,
the files disagreeing, a name the tokenizer does not hold) is left to the tokenizer itself:
None here means "load it and ask".
"""

from __future__ import annotations

import json
from pathlib import Path

from engine_service.model.config import ModelConfig


def read_eos_token_id(model_config: ModelConfig) -> int | None:
    """The id `load_tokenizer(model_config).eos_token_id` gives, or None when the files do
    not say it plainly."""
    if model_config.gguf_file is not None:
        return None
    path = Path(model_config.path)
    name = _eos_name(path)
    if name is None or not (path / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer  # the Rust library alone: milliseconds to import

    try:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - whatever it cannot read, transformers will say why
        return None
    return tokenizer.token_to_id(name)


def _eos_name(path: Path) -> str | None:
    """The EOS token's text; None when neither file names one, or the two disagree (which one
    wins is the tokenizer's business)."""
    names = set()
    for file_name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = _json(path / file_name)
        if config is None or "eos_token" not in config:
            continue
        token = config["eos_token"]
        if isinstance(token, dict):  # a serialized AddedToken
            token = token.get("content")
        names.add(token if isinstance(token, str) and token else None)
    return names.pop() if len(names) == 1 else None


def _json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
