"""n > 1: the prompt's blocks are shared by every sample, copy-on-write on divergence."""

import pytest

from engine_service import SamplingParams


def test_n4_shares_prompt_blocks_and_is_reproducible(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=128)
    engine = llm.llm_engine
    prompt = list(range(300, 340))  # 2 full blocks + a partial one
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    engine.add_request("r", prompt, params)
    engine.step()  # prefill + fork + first sampled tokens
    group = engine.scheduler.running[0]
    assert len(group.seqs) == 4
    tables = [engine.kv.block_table(s) for s in group.seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert [engine.pool.blocks[b].ref_count for b in tables[0][:2]] == [4, 4]
    engine.step()  # each sample writes into the shared partial block: copy-on-write
    last_blocks = {engine.kv.block_table(s)[2] for s in group.seqs}
    assert len(last_blocks) == 4
    while engine.has_unfinished_requests():
        outputs = engine.step()
    texts = [tuple(o.token_ids) for o in outputs[0].outputs]
    assert len(set(texts)) == 4, "four samples should differ"

    again = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert [tuple(o.token_ids) for o in again.outputs] == texts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_request_is_independent_of_batch(dtype, make_llm, tiny_llama_dir):
    if dtype == "bfloat16":
        from engine_service.model.models.packed_linear import bf16_linear_kernel

        if bf16_linear_kernel() not in ("amx", "vdpbf16ps"):
            pytest.skip("bf16 linears are not ours here (oneDNN's depend on the batch)")
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=256, dtype=dtype)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(
        [
            {"prompt_token_ids": [9, 10, 11]},
            {"prompt_token_ids": [5, 6, 7, 8]},
            {"prompt_token_ids": list(range(50, 90))},
        ],
        [others, seeded, others],
    )
    assert batch[1].outputs[0].token_ids == alone
