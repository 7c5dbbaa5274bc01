"""HF transformers peers on the same prompts and output lengths: static-batch `generate` and
continuous-batching `generate_batch` (paged cache). Greedy, no EOS stop, so every request
produces exactly its target number of tokens (static batching produces the batch maximum and
pays for the extra tokens, which is its real cost)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from bench.metrics import RequestRecord, run_duration
from bench.workloads import Workload

PAGE_SIZE = 256  # generate_batch's default page (tokens per block per layer)


@dataclass(slots=True)
class PeerRun:
    name: str
    records: list[RequestRecord]
    duration_s: float
    # Model forward passes the run made, where the peer exposes it (for the roofline's bytes).
    num_forward_passes: int | None = None


class _StepClock(LogitsProcessor):
    """Called once per generated token position, after that step's forward: its call times
    are the times the batch's tokens became available."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor):
        self.times.append(time.monotonic())
        return scores


def load_hf_model(model_path: str, dtype: str = "float32"):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model.eval()
    return model


def warm_up_hf(model, batch_size: int = 4, prompt_len: int = 256) -> None:
    """Untimed, as for our engine: one-off costs of the first large forward."""
    input_ids = torch.arange(batch_size * prompt_len).reshape(batch_size, prompt_len) + 100
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=_greedy_no_eos(4, 0),
        )


def _greedy_no_eos(max_new_tokens: int, pad_token_id: int) -> GenerationConfig:
    # eos_token_id None: generation runs to max_new_tokens without masking EOS, like ignore_eos.
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=pad_token_id,
    )


def run_static_generate(
    model, workload: Workload, batch_size: int, pad_token_id: int = 0, progress: bool = True
) -> PeerRun:
    """Batches of `batch_size` in arrival order, left-padded, one `generate` call each; all
    requests are sent at t=0 (a batch waits for the ones before it)."""
    requests = list(workload.requests)
    records = [RequestRecord(prompt_len=r.prompt_len) for r in requests]
    start = time.monotonic()
    for rec in records:
        rec.arrival = start
    batches = range(0, len(requests), batch_size)
    num_forward_passes = 0
    for first in tqdm(batches, desc=f"hf generate (batch {batch_size})", disable=not progress):
        batch = requests[first : first + batch_size]
        width = max(r.prompt_len for r in batch)
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            input_ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            attention_mask[row, width - r.prompt_len :] = 1
        max_new = max(r.output_len for r in batch)
        num_forward_passes += max_new
        clock = _StepClock()
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=_greedy_no_eos(max_new, pad_token_id),
                logits_processor=[clock],
            )
        end = time.monotonic()
        for row, r in enumerate(batch):
            rec = records[first + row]
            rec.token_times = clock.times[: r.output_len]
            rec.output_len = len(rec.token_times)
            rec.finish = end
    return PeerRun(
        f"hf_generate_static_b{batch_size}", records, run_duration(records), num_forward_passes
    )


def run_generate_batch(
    model, workload: Workload, max_batch_tokens: int = 2048, pad_token_id: int = 0
) -> PeerRun:
    """transformers' continuous batching. Its worker thread fails every request inside
    torch.inference_mode (transformers 5.23), so this runs under no_grad only.

    Its cache is sized to hold the whole workload at once: left to size itself on a CPU it
    allocates for ~20 s before the first token (measured with a 2-layer model), which would
    measure setup, not serving. Warm-up (CUDA graph capture) is off: there is no CUDA here."""
    requests = list(workload.requests)
    max_new = max(r.output_len for r in requests)
    if any(r.output_len != max_new for r in requests):
        raise ValueError("generate_batch takes one max_new_tokens: use a fixed-output workload")
    page = PAGE_SIZE
    num_blocks = sum(-(-(r.prompt_len + r.output_len) // page) for r in requests) + 4
    cb_config = ContinuousBatchingConfig(
        page_size=page, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens
    )
    # Its timestamps are time.perf_counter; keep every time of this peer on that clock.
    start = time.perf_counter()
    with torch.no_grad():
        outputs = model.generate_batch(
            inputs=[list(r.prompt_token_ids) for r in requests],
            generation_config=_greedy_no_eos(max_new, pad_token_id),
            continuous_batching_config=cb_config,
            record_timestamps=True,
            progress_bar=False,
            warmup=False,
        )
    end = time.perf_counter()
    by_prompt = {}
    for out in outputs.values():
        if out.error:
            raise RuntimeError(f"generate_batch request {out.request_id} failed: {out.error}")
        by_prompt.setdefault(tuple(out.prompt_ids), []).append(out)
    records = []
    for r in requests:
        out = by_prompt[r.prompt_token_ids].pop()
        times = list(out.timestamps or [])[: r.output_len]
        records.append(
            RequestRecord(
                prompt_len=r.prompt_len,
                output_len=len(times),
                arrival=start,
                token_times=times,
                finish=times[-1] if times else end,
            )
        )
    return PeerRun("hf_generate_batch", records, end - start)
