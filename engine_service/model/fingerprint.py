"""A fingerprint of a checkpoint's content: what, with the served model name, seeds block hashes.

Two replicas that mount the same checkpoint at different paths must hash the same tokens to the
same blocks (the router and the index match them by hash), and a checkpoint replaced in place
must not: so the identity comes from the bytes, not the path. The files hashed are the weights
and config.json (its RoPE and norm settings change the KV as much as the weights do); the
tokenizer is not (block hashes are over token ids).

Hashing a large checkpoint reads all of it (xxh3-128, at disk or page-cache speed), so the
answer is kept in the cache directory keyed by each file's path, size, inode and change times: a
file rewritten in place gets a new ctime even when its mtime is preserved (`cp -p`), so a stale
answer is never read back for changed bytes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import xxhash

from engine_service.model.paths import cache_dir

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CHUNK_BYTES = 16 << 20
# Bump when what goes into the fingerprint changes: older cached answers are then not read.
FINGERPRINT_VERSION = b"pagedgen-weights-v1"


def checkpoint_files(path: Path, gguf_file: str | None) -> list[Path]:
    """The files a fingerprint covers, in a fixed order: the GGUF file alone, else config.json
    and every weight file of the directory (sharded checkpoints included)."""
    if gguf_file is not None:
        return [path / gguf_file]
    files = [p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    config = path / "config.json"
    if config.is_file():
        files.append(config)
    return sorted(files, key=lambda p: p.name)


def _stat_key(files: list[Path]) -> str:
    h = xxhash.xxh3_128(FINGERPRINT_VERSION)
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}|{st.st_ctime_ns}\n"
                 .encode())
    return h.hexdigest()


def _content_hash(files: list[Path]) -> str:
    h = xxhash.xxh3_128(FINGERPRINT_VERSION)
    for f in files:
        # The name relative to the checkpoint and the size frame each file's bytes.
        h.update(f"{f.name}|{f.stat().st_size}\n".encode())
        with open(f, "rb") as stream:
            while chunk := stream.read(CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()


def weights_fingerprint(path: Path, gguf_file: str | None, use_cache: bool = True) -> str:
    """32 hex digits naming the checkpoint's content (see the module docstring)."""
    files = checkpoint_files(path, gguf_file)
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no weight files "
                         f"({', '.join(WEIGHT_SUFFIXES)})")
    if not use_cache:
        return _content_hash(files)
    entry = cache_dir() / "fingerprints" / _stat_key(files)
    try:
        cached = entry.read_text().strip()
        if len(cached) == 32:
            return cached
    except OSError:
        pass
    fingerprint = _content_hash(files)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = entry.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(fingerprint)
        partial.replace(entry)  # atomic: a concurrent reader sees all of it or nothing
    except OSError as error:  # a read-only cache (a locked-down pod) only costs the next start
        log.info("weights fingerprint not cached (%s): it is computed again next start", error)
    return fingerprint


def model_identity(served_model_name: str, fingerprint: str, architecture: str) -> str:
    """What block hashes are seeded with (the dtype and block size are added by BlockHasher)."""
    return f"{served_model_name}:{fingerprint}:{architecture}"
