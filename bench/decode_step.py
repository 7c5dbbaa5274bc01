"""One engine decode step, timed and split into matmul / attention / other.

    python -m bench.decode_step                          # fp32 and bf16, batch 1 and 32
    python -m bench.decode_step --dtypes bfloat16 --batches 1 --backends auto,torch --profile
    python -m bench.decode_step --pages huge,4k --rounds 4   # huge pages against 4 KiB ones
    python -m bench.decode_step --device cuda --dtypes bfloat16 --batches 1,64 --model DIR

`batch` sequences with `context`-token prompts are prefilled, then `steps` pure decode steps are
timed (each produces one token per sequence). The split is taken in a second pass in which every
linear layer and every attention call is wrapped in a perf_counter timer (torch CPU ops are
synchronous, so the wall time around a call is its cost): matmul = the linears (LM head
included), attention = K/V cache writes + paged attention, other = the rest of the step
(norms, RoPE, activations, embedding, tensor building, sampling, scheduling). The timers add
about a microsecond per call; the split is reported as fractions of that pass's step time.
Where the layers run as one C++ call (on the CPU: float32, bf16 on AVX512-BF16), that op times
its own linears and attention calls, with the same clock as the steps (thread CPU time with
one torch thread, else wall time), and the result says so (fused_layers).
`pagedgen-bench` records this split next to its throughput figures, so a ratio that moves
between machines can be explained from the results file.
On CUDA only the step time is taken: kernels run asynchronously, so a host timer around a call
measures its launch, not its work (the split's fractions are NaN there). A step still ends
with the sampled tokens read back to the host, so its wall time is the device's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine_service.model.huge_pages import huge_pages_supported


@dataclass(slots=True)
class StepSplit:
    step_ms: float  # median of the untimed pass
    tokens_per_s: float  # batch / step time
    matmul_frac: float
    attention_frac: float
    other_frac: float


@dataclass(slots=True)
class StepResult:
    dtype: str
    batch: int
    context: int
    kernel_backend: str  # the backend the runner really used ("cpu", "torch", ...)
    split: StepSplit
    fused_layers: bool = False  # the layers ran as one C++ call (fused_decoder.py)
    # "huge": packed weights and KV pool as the engine places them (huge pages on Linux);
    # "4k": both copied into torch's own allocations, the baseline huge pages replace
    pages: str = "huge"
    cuda_graphs: bool = False  # the timed steps replayed captured CUDA graphs


PAGE_KINDS = ("huge", "4k")


def step_clock(device: str = "cpu") -> Callable[[], float]:
    """With one torch thread all the work runs on this thread, so its CPU time measures the
    step without the time a shared machine keeps it descheduled; otherwise, and on a GPU
    (whose work this thread only waits for), wall time."""
    if device == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


class _Timer:
    """Accumulates the time of the calls it wraps."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.clock = step_clock()

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += self.clock() - start

        return timed


def _linear_modules(model: nn.Module) -> list[nn.Module]:
    from engine_service.model.models.packed_linear import PackedLinear

    return [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]


def _fill(engine, batch: int, context: int, steps: int) -> None:
    from engine_service.model.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
    for i in range(batch):
        # Distinct prompts (no prefix-cache hits), ids well inside every vocabulary we run.
        tokens = [100 + (i * 7919 + j * 31) % 20000 for j in range(context)]
        engine.add_request(f"decode-step-{i}", tokens, params)
    # Prefill until every sequence decodes one token per step.
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_tokens - 1 for s in _running(engine)
    ):
        engine.step()


def _running(engine):
    return [seq for group in engine._groups.values() for seq in group.seqs]


def _timed_steps(engine, steps: int) -> list[float]:
    clock = step_clock(engine.config.device)
    times = []
    for _ in range(steps):
        start = clock()
        engine.step()
        times.append(clock() - start)
    return times


def _ordinary_pages(runner) -> None:
    """The baseline that engine_service/model/huge_pages.py replaces: the packed weights and
    the KV pool copied into torch's own allocations (4 KiB pages where THP is `madvise`, as
    torch asks for none unless THP_MEM_ALLOC_ENABLE is set)."""
    from engine_service.model.models.fused_decoder import build_fused_decoder
    from engine_service.model.models.packed_linear import PackedLinear

    for module in runner.model.modules():
        if isinstance(module, PackedLinear) and module.ours:
            module.packed_weight = module.packed_weight.clone()
    if runner.model.fused_decoder is not None:
        runner.model.fused_decoder = build_fused_decoder(runner.model)
    runner.kv_caches = runner.kv_caches.clone()


def measure(model: str, dtype: str, batch: int, context: int, steps: int,
            kernel_backend: str = "auto", profile: bool = False,
            pages: str = "huge", device: str = "cpu", enforce_eager: bool = False) -> StepResult:
    from engine_service import LLM

    if pages not in PAGE_KINDS:
        raise ValueError(f"pages must be one of {PAGE_KINDS}, got {pages!r}")
    engine = LLM(model=model, dtype=dtype, kernel_backend=kernel_backend, device=device,
                 max_num_seqs=max(batch, 1), enable_prefix_caching=False,
                 enforce_eager=enforce_eager).llm_engine
    runner = engine.runner
    if pages == "4k":
        _ordinary_pages(runner)
    _fill(engine, batch, context, 2 * steps + 2)
    _timed_steps(engine, 2)  # warm
    step_s = statistics.median(_timed_steps(engine, steps))
    if device != "cpu":
        for request_id in list(engine._groups):
            engine.abort_request(request_id)
        backend_name = runner.kernels.name
        graphs = runner.decode_graphs is not None and runner.decode_graphs.num_replays > 0
        # The next case plans its KV pool from the device's free memory: give this one's back.
        del engine, runner
        gc.collect()
        torch.cuda.empty_cache()
        nan = float("nan")
        split = StepSplit(step_ms=step_s * 1e3, tokens_per_s=batch / step_s, matmul_frac=nan,
                          attention_frac=nan, other_frac=nan)
        return StepResult(dtype, batch, context, backend_name, split, False, pages, graphs)

    # Second pass with timers around the linears and the attention calls.
    matmul, attention = _Timer(), _Timer()
    linears = _linear_modules(runner.model)
    for module in linears:
        module.forward = matmul.wrap(module.forward)
    plain_kernels = runner.kernels
    runner.kernels = dataclasses.replace(
        plain_kernels,
        paged_attention=attention.wrap(plain_kernels.paged_attention),
        reshape_and_cache=attention.wrap(plain_kernels.reshape_and_cache),
    )
    # The fused layer loop (engine_service/model/models/fused_decoder.py) calls its
    # linears and attention inside one C++ op, which times them itself when asked, with the
    # same clock as step_clock.
    fused = runner.model.fused_decoder if plain_kernels.fused_layers else None
    if fused is not None:
        fused.timings = torch.zeros(2, dtype=torch.float64)
    try:
        timed_total = sum(_timed_steps(engine, steps))
    finally:
        for module in linears:
            del module.forward  # back to the class's forward
        runner.kernels = plain_kernels
        if fused is not None:
            matmul.seconds += fused.timings[0].item()
            attention.seconds += fused.timings[1].item()
            fused.timings = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            _timed_steps(engine, min(steps, 5))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    for request_id in list(engine._groups):
        engine.abort_request(request_id)
    split = StepSplit(
        step_ms=step_s * 1e3,
        tokens_per_s=batch / step_s,
        matmul_frac=matmul.seconds / timed_total,
        attention_frac=attention.seconds / timed_total,
        other_frac=1 - (matmul.seconds + attention.seconds) / timed_total,
    )
    return StepResult(dtype, batch, context, plain_kernels.name, split, fused is not None, pages)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.decode_step", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--backends", default="auto", help="kernel backends, e.g. auto,torch")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (1: timed in thread CPU time, robust to a busy machine)")
    p.add_argument("--pages", default="huge",
                   help="where the packed weights and KV pool live: huge (as the engine "
                        "places them), 4k (torch's allocations, the baseline), or both: huge,4k")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every case this many times, the --pages variants alternating "
                        "(this machine's noise hides a 10%% difference in one pair)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: step times only (see above)")
    p.add_argument("--cuda-graphs", default="on",
                   help="cuda: decode steps as CUDA graphs (on), eagerly (off), or both: on,off")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top ops")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    pages_list = args.pages.split(",")
    graph_modes = args.cuda_graphs.split(",")
    if bad := [x for x in graph_modes if x not in ("on", "off")]:
        p.error(f"--cuda-graphs takes on and/or off, got {bad}")
    if args.device == "cpu":
        graph_modes = ["off"]
    if bad := [x for x in pages_list if x not in PAGE_KINDS]:
        p.error(f"--pages takes huge and/or 4k, got {bad}")
    if args.device == "cuda":
        pages_list = ["huge"]  # the device's memory: the CPU page kinds do not apply
    elif "huge" in pages_list and not huge_pages_supported():
        print("no MADV_HUGEPAGE here: 'huge' runs on ordinary pages too", flush=True)
    if args.model is None:
        from engine_service.tools.prepare_model import ensure_default_model

        args.model = str(ensure_default_model())
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results = []
    clock = "thread CPU time" if step_clock(args.device) is time.thread_time else "wall time"
    print(f"clock: {clock}; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    for round_index, dtype, batch, backend, graph_mode, pages_index in itertools.product(
        range(args.rounds), args.dtypes.split(","), [int(b) for b in args.batches.split(",")],
        args.backends.split(","), graph_modes, range(len(pages_list)),
    ):
        # Each round runs the variants in the other order, so neither always goes first.
        order = pages_list if round_index % 2 == 0 else pages_list[::-1]
        pages = order[pages_index]
        r = measure(args.model, dtype, batch, args.context, args.steps, backend, args.profile,
                    pages, args.device, enforce_eager=graph_mode == "off")
        results.append(r)
        s = r.split
        print(f"{dtype:9} batch {batch:3} ctx {args.context} backend {r.kernel_backend:6} "
              f"pages {pages:4} graphs {r.cuda_graphs!s:5} step {s.step_ms:7.2f} ms  "
              f"{s.tokens_per_s:7.1f} tok/s  matmul "
              f"{s.matmul_frac:5.1%} attention {s.attention_frac:5.1%} other "
              f"{s.other_frac:5.1%}", flush=True)
    print(f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=2))


if __name__ == "__main__":
    main()
