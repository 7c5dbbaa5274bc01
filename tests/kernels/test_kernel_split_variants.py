"""The split-KV counts the warm-up compiles are exactly those the engine can choose."""

import pytest

from kernels.triton_attention import kv_splits_for, reachable_kv_splits


@pytest.mark.parametrize(("num_sms", "num_kv_heads", "block_size"),
                         [(132, 8, 16), (132, 2, 16), (108, 8, 32), (16, 4, 8), (132, 64, 16)])
def test_reachable_splits_match_every_batch_the_engine_can_run(num_sms, num_kv_heads,
                                                               block_size) -> None:
    max_num_seqs, max_model_len = 48, 8192
    bound = -(-max_model_len // block_size) * block_size
    # Every batch size and every table width (the bound is table width x block size).
    chosen = {
        kv_splits_for(num_seqs, num_kv_heads, width * block_size, num_sms)
        for num_seqs in range(1, max_num_seqs + 1)
        for width in range(1, bound // block_size + 1)
    }
    assert reachable_kv_splits(max_num_seqs, num_kv_heads, bound, num_sms) == sorted(chosen)
