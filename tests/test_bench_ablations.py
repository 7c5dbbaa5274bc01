"""The paper's ablation sections of pagedgen-bench (issue 34), on tiny models: what they count
is what the engine holds, independent of the weights. Behaviour only, no timings."""

from bench.parallel_sampling import ParallelShape, parallel_sampling_bench

SMALL = ParallelShape(num_requests=2, widths=(1, 3), sharegpt_scale=0.1)


def _counts(result: dict) -> list[tuple]:
    return [(r["workload"], r["n"], r["shared_block_steps"], r["unshared_block_steps"],
             r["peak_unshared_blocks"], r["shared_at_peak"]) for r in result["runs"]]


def test_parallel_sampling_counts_blocks_shared_by_the_samples(tiny_llama_dir, tiny_qwen2_dir):
    llama = parallel_sampling_bench(str(tiny_llama_dir), SMALL, seed=0, log=lambda _: None)
    for r in llama["runs"]:
        assert r["num_preemptions"] == 0, r
        assert r["num_steps"] > 0
        if r["n"] == 1:  # one sample shares with nobody: the same blocks either way
            assert r["shared_block_steps"] == r["unshared_block_steps"], r
            assert r["saving"] == 0.0
        else:
            assert 0 < r["shared_block_steps"] < r["unshared_block_steps"], r
    for name in ("sharegpt_like", "alpaca_like"):
        savings = [r["saving"] for r in llama["runs"] if r["workload"] == name]
        assert savings == sorted(savings) and savings[-1] > savings[0], (name, savings)
    # Another architecture with other random weights samples other tokens, but holds the same
    # blocks: the counts are the workload's, which is why the section runs on a tiny model.
    qwen = parallel_sampling_bench(str(tiny_qwen2_dir), SMALL, seed=0, log=lambda _: None)
    assert _counts(qwen) == _counts(llama)


def _engine_on(model_dir):
    from engine_service import LLM

    return lambda **overrides: LLM(model=str(model_dir), dtype="float32",
                                   **overrides).llm_engine


def test_preemption_section_preempts_only_under_pressure(tiny_llama_dir):
    from bench.preemption import PreemptionShape, preemption_bench
    from bench.sections import preemption

    shape = PreemptionShape(block_sizes=(8, 32), tokens=64, repeats=1, num_requests=4,
                            prompt_range=(16, 32), output_len=16, pool_fraction=0.4)
    result = preemption_bench(_engine_on(tiny_llama_dir), shape, seed=0, log=lambda _: None)
    for cost in result["block_costs"]:
        assert cost["num_blocks"] == 64 // cost["block_size"]
        assert min(cost["swap_out_ms"], cost["swap_in_ms"], cost["recompute_ms"]) > 0
    pools = {}
    for run in result["pressure"]:
        if run["mode"] == "none":
            assert run["num_preemptions"] == 0 and run["pool_tokens"] >= run["peak_demand_tokens"]
        else:
            assert run["num_preemptions"] > 0, run
            pools.setdefault(run["block_size"], set()).add(run["pool_tokens"])
        assert run["output_throughput"] > 0
    # The same pool for both modes at a block size, and the same memory across block sizes
    # (rounded up to a whole block): the same pressure.
    assert all(len(sizes) == 1 for sizes in pools.values()), pools
    assert max(min(s) for s in pools.values()) - min(min(s) for s in pools.values()) < 32
    report = "\n".join(preemption.report({"preemption": {**result, "dtype": "float32"}}, "."))
    assert "| 8 | 8 |" in report and "| 32 | 2 |" in report  # block size, blocks moved
    assert "| all fit |" in report and ", recompute |" in report and ", swap |" in report


def test_block_size_sweep_runs_every_size(tiny_llama_dir):
    import math

    from bench.block_sizes import BlockSizeShape, block_size_sweep
    from bench.harness import workload_info
    from bench.sections import block_sizes
    from bench.workloads import sharegpt_like

    workload = sharegpt_like(4, 512, seed=0, scale=0.2)
    result = block_size_sweep(_engine_on(tiny_llama_dir), workload,
                              BlockSizeShape((8, 32), 1), math.inf, 0, log=lambda _: None)
    best = {r["block_size"]: r for r in result["best"]}
    assert set(best) == {8, 32}
    for r in best.values():
        assert r["num_preemptions"] == 0 and r["output_throughput"] > 0
        assert 0 < r["kv_utilization"] <= 1
    # Every request sent at once: the same steps at both sizes, and smaller blocks leave fewer
    # slots empty in each sequence's last block.
    assert best[8]["kv_utilization"] > best[32]["kv_utilization"]
    section = {**result, "workload": workload_info(workload), "dtype": "float32"}
    rows = [line for line in block_sizes.report({"block_sizes": section}, ".")
            if line.startswith(("| 8 |", "| 32 |"))]
    assert len(rows) == 2
