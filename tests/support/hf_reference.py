"""Reference outputs from HF transformers, the ground truth the engine is compared with: greedy
runs, beam search, and teacher-forced logprobs of the engine's own outputs.

One prompt at a time, float32 unless a test asks for another dtype, no padding: an unpadded
forward is what our engine computes, so the numerics line up. Loaded models and finished
generations are cached per process (several test files ask for the same references).
"""

import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel


@functools.lru_cache(maxsize=4)
def load_hf_model(model_dir: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The HF model in model_dir (float32 unless asked), in eval mode (cached: at most a few
    live at once)."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="sdpa"
    )
    return model.eval()


@functools.lru_cache(maxsize=4096)
def _greedy_one(
    model_dir: str, prompt: tuple[int, ...], max_new_tokens: int, ignore_eos: bool
) -> tuple[int, ...]:
    if not prompt:
        raise ValueError("prompt must hold at least one token id")
    model = load_hf_model(model_dir)
    base = model.generation_config
    eos_token_id = [] if ignore_eos else base.eos_token_id
    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        # An empty EOS list: generate never stops early, yet EOS may still win the argmax, as
        # with vLLM's ignore_eos (min_new_tokens would mask EOS out and change the greedy
        # choice). None would not do: generate fills None from the model's generation_config.
        eos_token_id=eos_token_id,
        pad_token_id=base.pad_token_id if base.pad_token_id is not None else base.eos_token_id,
        bos_token_id=base.bos_token_id,
    )
    input_ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=generation_config,
        )
    return tuple(output[0, len(prompt) :].tolist())


def _generate(
    model_dir: Path | str, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool
) -> list[list[int]]:
    key = str(Path(model_dir).resolve())
    return [list(_greedy_one(key, tuple(prompt), max_new_tokens, ignore_eos)) for prompt in prompts]


def hf_greedy(
    model_dir: Path | str, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuations (generated ids only); each stops after EOS, which it includes."""
    return _generate(model_dir, prompts, max_new_tokens, ignore_eos=False)


def hf_greedy_ignore_eos(
    model_dir: Path | str, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuations of exactly max_new_tokens ids each, running on through EOS."""
    return _generate(model_dir, prompts, max_new_tokens, ignore_eos=True)


def hf_greedy_logit_margins(
    model_dir: Path | str, prompt: list[int], max_new_tokens: int
) -> list[float]:
    """Top-1 minus top-2 logit at each step of an ignore-EOS greedy run.

    A tiny margin means float reordering could flip that argmax; tests use this to check that a
    reference model is robust enough for token-for-token comparisons.
    """
    model = load_hf_model(str(Path(model_dir).resolve()))
    generated = hf_greedy_ignore_eos(model_dir, [prompt], max_new_tokens)[0]
    full = torch.tensor([prompt + generated], dtype=torch.long)
    with torch.inference_mode():
        logits = model(full).logits[0, len(prompt) - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def hf_greedy_top_logprobs(
    model_dir: Path | str, prompt: list[int], max_new_tokens: int, dtype: torch.dtype, k: int = 5
) -> list[tuple[int, dict[int, float]]]:
    """An ignore-EOS greedy run of the HF model in `dtype`: per generated token, (token id,
    {top-k token id: logprob}), logprobs from the raw logits (log-softmax in float32).
    Cached per process: tests at several block sizes ask for the same reference."""
    key = str(Path(model_dir).resolve())
    return _greedy_top_logprobs(key, tuple(prompt), max_new_tokens, dtype, k)


@functools.lru_cache(maxsize=1024)
def _greedy_top_logprobs(
    model_dir: str, prompt: tuple[int, ...], max_new_tokens: int, dtype: torch.dtype, k: int
) -> list[tuple[int, dict[int, float]]]:
    model = load_hf_model(model_dir, dtype)
    base = model.generation_config
    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=[],
        pad_token_id=base.pad_token_id if base.pad_token_id is not None else base.eos_token_id,
        bos_token_id=base.bos_token_id,
        output_logits=True,  # raw logits, before any logits processor
        return_dict_in_generate=True,
    )
    input_ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=generation_config,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    steps = []
    for token, logits in zip(tokens, out.logits, strict=True):
        logprobs = torch.log_softmax(logits[0].float(), dim=-1)
        top = logprobs.topk(k)
        steps.append((token, dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))))
    return steps


@functools.lru_cache(maxsize=1024)
def _beam_search_one(
    model_dir: str,
    prompt: tuple[int, ...],
    num_beams: int,
    num_return_sequences: int,
    max_new_tokens: int,
    length_penalty: float,
    early_stopping: bool | str,
    eos_token_ids: tuple[int, ...],
    min_new_tokens: int,
    dtype: torch.dtype,
) -> tuple[tuple[tuple[int, ...], float], ...]:
    model = load_hf_model(model_dir, dtype)
    base = model.generation_config
    generation_config = GenerationConfig(
        do_sample=False,
        num_beams=num_beams,
        num_return_sequences=num_return_sequences,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens or None,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        # An empty list: no token ends a beam (ignore_eos); None would take the model's.
        eos_token_id=list(eos_token_ids),
        pad_token_id=base.pad_token_id if base.pad_token_id is not None else 0,
        bos_token_id=base.bos_token_id,
        return_dict_in_generate=True,
        output_scores=True,
    )
    input_ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids),
            generation_config=generation_config,
        )
    beams = []
    for row, indices, score in zip(
        out.sequences, out.beam_indices, out.sequences_scores, strict=True
    ):
        # beam_indices is -1 past a beam's last generated token: it gives each one's length
        # (the rows are padded to the longest).
        length = int((indices != -1).sum())
        beams.append((tuple(row[len(prompt) : len(prompt) + length].tolist()), float(score)))
    return tuple(beams)


def hf_beam_search(
    model_dir: Path | str,
    prompt: list[int],
    num_beams: int,
    num_return_sequences: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    eos_token_ids: list[int] | tuple[int, ...] = (),
    min_new_tokens: int = 0,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[list[int], float]]:
    """HF `generate(num_beams=..., do_sample=False)` of one prompt in `dtype` (float32 unless
    asked): the returned beams, best first, as (generated ids with the EOS that ended them,
    length-penalized score). Cached per process."""
    key = str(Path(model_dir).resolve())
    beams = _beam_search_one(
        key, tuple(prompt), num_beams, num_return_sequences, max_new_tokens, length_penalty,
        early_stopping, tuple(eos_token_ids), min_new_tokens, dtype,
    )
    return [(list(tokens), score) for tokens, score in beams]


def hf_teacher_forced_logprobs(
    model_dir: Path | str, prompt: list[int], continuation: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """Log-probabilities [len(continuation), vocab] (float32) the HF model in `dtype` gives
    each position of `continuation` after `prompt` and the continuation's earlier tokens: one
    forward pass over prompt + continuation, log-softmax of the raw logits in float32 (as
    `hf_greedy_top_logprobs`). Row i is the distribution continuation[i] was drawn from."""
    if not prompt or not continuation:
        raise ValueError(
            f"prompt and continuation must hold at least one token id each, got "
            f"{len(prompt)} and {len(continuation)}"
        )
    model = load_hf_model(str(Path(model_dir).resolve()), dtype)
    input_ids = torch.tensor([list(prompt) + list(continuation)], dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)
