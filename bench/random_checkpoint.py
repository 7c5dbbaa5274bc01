"""A random-init checkpoint directory of a given shape, written fast enough for a GPU lease.

    python -m bench.random_checkpoint --shape llama-8b --tokenizer DIR --out DIR [--device cuda]

It has what the engine loads from a real checkpoint (config.json, generation_config.json,
bf16 safetensors shards, the tokenizer files copied from `--tokenizer`), so the engine serves it
as it would the real model; only the weights are noise. Step times do not depend on the
weights' values, so a random model of a real model's shape times its steps. Shapes:
    smollm2   SmolLM2-135M's config (the default model), for a machine that cannot carry its
              weights (the GPU lease carries 64 MiB, the weights are 538 MB)
    llama-8b  Llama-3-8B's layers (32 x 4096 hidden, 14336 MLP, 32 query / 8 KV heads of 128)
              with SmolLM2's 49,152-token vocabulary, the tokenizer we have offline (Llama-3's
              vocabulary is 128,256): 7.4 B parameters, 14.8 GB in bf16
Each tensor is drawn on `--device` (a GPU draws 7.4 B values in well under a second; the CPU
takes minutes) from N(0, 0.02), as HF initializes; the norm weights are 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SHARD_BYTES = 4 << 30
INIT_STD = 0.02

# Llama-3-8B's layer shapes; the vocabulary is the tokenizer's (see the module docstring).
LLAMA_8B_LAYERS = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=False,
)
SHAPES = ("smollm2", "llama-8b")


def _config(shape: str, tokenizer_dir: Path) -> dict:
    """config.json's contents: the tokenizer directory's own config (SmolLM2's), with
    Llama-3-8B's layers laid over it for llama-8b."""
    config = json.loads((tokenizer_dir / "config.json").read_text())
    if shape == "llama-8b":
        config.update(LLAMA_8B_LAYERS, _model_name_or_path="random-llama-8b-shape")
    config["dtype"] = "bfloat16"
    return config


def _parameter_shapes(config_dir: Path) -> dict[str, tuple[int, ...]]:
    """The HF parameter names and shapes, from a meta-device instance (nothing allocated);
    a tied lm_head is left out, as HF saves it."""
    hf_config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def write_random_checkpoint(shape: str, tokenizer_dir: Path, out_dir: Path,
                            device: str = "cpu", seed: int = 0) -> Path:
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(_config(shape, tokenizer_dir), indent=2))
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    generator = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    shard_count = 0

    def flush() -> None:
        nonlocal shard, shard_bytes, shard_count
        shard_count += 1
        save_file(shard, out_dir / f"model-{shard_count:05d}.safetensors",
                  metadata={"format": "pt"})
        shard, shard_bytes = {}, 0

    for name, dims in _parameter_shapes(out_dir).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensor = torch.randn(dims, generator=generator, device=device,
                                 dtype=torch.bfloat16).mul_(INIT_STD).cpu()
        shard[name] = tensor
        shard_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    return out_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.random_checkpoint",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="a directory with SmolLM2's config.json and tokenizer files")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cpu", help="where the values are drawn (cuda: fast)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = write_random_checkpoint(args.shape, args.tokenizer, args.out, args.device, args.seed)
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out}: {args.shape}, {total / 1e9:.2f} GB of bf16 safetensors", flush=True)


if __name__ == "__main__":
    main()
