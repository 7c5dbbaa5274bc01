"""A random-init checkpoint directory of a given shape, written fast enough for a GPU lease.

    python -m bench.random_checkpoint --shape llama-8b --tokenizer DIR --out DIR [--device cuda]

It has what the engine and HF transformers load from a real checkpoint (config.json,
generation_config.json, one bf16 model.safetensors, tokenizer files), so both serve it as
they would the real model; only the weights are noise. Step times do not depend on the
weights' values, so a random model of a real model's shape times its steps. Shapes:
    smollm2   SmolLM2-135M's config (the default model), for a machine that cannot carry its
              weights (the GPU lease carries 64 MiB, the weights are 538 MB)
    llama-8b  Llama-3-8B: its layers (32 x 4096 hidden, 14336 MLP, 32 query / 8 KV heads of
              128) and its 128,256-token vocabulary (untied): 8.0 B parameters, 16.1 GB in bf16
    qwen3-0.6b  Qwen3-0.6B (q and k norms, tied, a 151,936-token vocabulary): 1.2 GB in bf16
    tiny      two small layers (the GPU check's dry run on a CPU)
`--tokenizer` is a directory with SmolLM2's config.json and tokenizer files (what we have
offline). Where the shape's vocabulary is larger than the tokenizer's (llama-8b: 128,256 vs
49,152), the tokenizer is padded with reserved tokens up to it, so every id the model can
sample decodes; prompts are encoded as SmolLM2 would.

Each tensor is drawn on `--device` (a GPU draws 8 B values in well under a second; the CPU
takes minutes) from N(0, 0.02), as HF initializes; the norm weights are 1. The file is
written tensor by tensor (a safetensors header, then each tensor's bytes as drawn), so the
host holds one tensor at a time. A directory already written with the same arguments is kept
(a marker file, written last, records them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
WEIGHTS_FILE = "model.safetensors"
MARKER_FILE = "random_checkpoint.json"
INIT_STD = 0.02

# Llama-3-8B's layers and vocabulary.
LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=False, vocab_size=128256,
)
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
)
# SmolLM2-135M's size with heads that split over 2 ranks (8 query / 2 KV heads of 64, in its
# hidden 576): the tensor-parallel benchmark's model (bench/tensor_parallel.py).
SMOLLM2_8H2KV = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64)
# Qwen3-0.6B: 28 layers x 1024 hidden, 3072 MLP, 16 query / 8 KV heads of 128 (wider than
# hidden / heads), per-head q and k norms, its 151,936-token vocabulary, tied: 0.6 B parameters.
QWEN3_06B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True, vocab_size=151936, attention_bias=False,
    use_sliding_window=False, sliding_window=None, max_window_layers=28,
)
SHAPES = ("smollm2", "smollm2-8h2kv", "llama-8b", "qwen3-0.6b", "tiny")


def _config(shape: str, tokenizer_dir: Path) -> dict:
    """config.json's contents: the tokenizer directory's own config (SmolLM2's), with the
    shape's sizes laid over it."""
    config = json.loads((tokenizer_dir / "config.json").read_text())
    if shape == "llama-8b":
        config.update(LLAMA_8B, _model_name_or_path="random-llama-3-8b-shape")
    elif shape == "qwen3-0.6b":
        config.update(QWEN3_06B, _model_name_or_path="random-qwen3-0.6b-shape")
    elif shape == "tiny":
        config.update(TINY, _model_name_or_path="random-tiny")
    elif shape == "smollm2-8h2kv":
        config.update(SMOLLM2_8H2KV, _model_name_or_path="random-smollm2-8h2kv")
    config["dtype"] = "bfloat16"
    return config


def pad_tokenizer(tokenizer_json: dict, vocab_size: int) -> dict:
    """The tokenizer with reserved tokens appended up to `vocab_size` ids (as Llama-3 reserves
    its last 256). BPE never produces them from text; decoding one gives its name."""
    vocab = tokenizer_json["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in tokenizer_json.get("added_tokens", [])}
    size = max(used) + 1
    if vocab_size < size:
        raise ValueError(f"vocab_size must be at least the tokenizer's {size}, got {vocab_size}")
    for token_id in range(size, vocab_size):
        name = f"<|reserved_{token_id}|>"
        if name in vocab:
            raise ValueError(f"the tokenizer already has a token named {name!r}")
        vocab[name] = token_id
    return tokenizer_json


def parameter_shapes(config_dir: Path) -> dict[str, tuple[int, ...]]:
    """The HF parameter names and shapes, from a meta-device instance (nothing allocated);
    a tied lm_head is left out, as HF saves it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _header(shapes: dict[str, tuple[int, ...]]) -> bytes:
    """A safetensors header: little-endian u64 length, then JSON naming each tensor's dtype,
    shape and byte range in the data that follows (padded to 8 bytes with spaces)."""
    entries: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in shapes.items():
        nbytes = 2 * _numel(dims)
        entries[name] = {"dtype": "BF16", "shape": list(dims),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def write_random_checkpoint(shape: str, tokenizer_dir: Path, out_dir: Path,
                            device: str = "cpu", seed: int = 0,
                            vocab_size: int | None = None) -> Path:
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    config = _config(shape, tokenizer_dir)
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    marker = {"shape": shape, "seed": seed, "config": config}
    marker_path = out_dir / MARKER_FILE
    if marker_path.is_file() and json.loads(marker_path.read_text()) == marker:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    marker_path.unlink(missing_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    (out_dir / "tokenizer.json").write_text(
        json.dumps(pad_tokenizer(tokenizer, config["vocab_size"]), ensure_ascii=False),
        encoding="utf-8")

    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(name: str, dims: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(dims, dtype=torch.bfloat16)
        return torch.randn(dims, generator=generator, device=device,
                           dtype=torch.bfloat16).mul_(INIT_STD)

    write_safetensors(out_dir / WEIGHTS_FILE, parameter_shapes(out_dir), draw)
    marker_path.write_text(json.dumps(marker, indent=2))
    return out_dir


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]],
                      draw: Callable[[str, tuple[int, ...]], torch.Tensor]) -> None:
    """A bf16 safetensors file of `shapes`, each tensor made by `draw(name, shape)` and
    written as soon as it is made (one tensor on the host at a time)."""
    with open(path, "wb") as f:
        f.write(_header(shapes))
        for name, dims in shapes.items():
            tensor = draw(name, dims).to(torch.bfloat16).cpu().contiguous()
            if tuple(tensor.shape) != tuple(dims):
                raise ValueError(f"{name}: drew {tuple(tensor.shape)}, expected {dims}")
            f.write(tensor.view(-1).view(torch.uint8).numpy().data)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.random_checkpoint",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="a directory with SmolLM2's config.json and tokenizer files")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cpu", help="where the values are drawn (cuda: fast)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="default: the shape's (llama-8b: 128,256), else the tokenizer's")
    args = p.parse_args(argv)
    out = write_random_checkpoint(args.shape, args.tokenizer, args.out, args.device, args.seed,
                                  args.vocab_size)
    total = (out / WEIGHTS_FILE).stat().st_size
    print(f"wrote {out}: {args.shape}, {total / 1e9:.2f} GB of bf16 safetensors", flush=True)


if __name__ == "__main__":
    main()
