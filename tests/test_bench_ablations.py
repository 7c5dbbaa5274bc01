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
