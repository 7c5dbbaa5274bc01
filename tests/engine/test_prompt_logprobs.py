"""prompt_logprobs: each prompt token's logprob (and top-k) under the model, as HF's forward
over the prompt gives them, whatever the chunking, the prefix cache or preemption did."""

import random

import pytest
import torch

from engine_service import SamplingParams
from tests.engine.prompts import parity_prompts
from tests.support.hf_reference import hf_teacher_forced_logprobs

# Two float32 forwards (ours, HF's) agree to about 1e-5 on a logprob: a rank or a top-k
# membership is checked up to the tokens within this of the one in question.
TIE = 1e-4


def _check_against_hf(model_dir, prompt: list[int], scored: list, k: int) -> None:
    assert len(scored) == len(prompt) and scored[0] is None
    if len(prompt) == 1:
        return
    reference = hf_teacher_forced_logprobs(model_dir, prompt[:1], prompt[1:], torch.float32)
    for i, (token, entry, row) in enumerate(zip(prompt[1:], scored[1:], reference,
                                                strict=True)):
        where = f"position {i + 1}"
        value = row[token].item()
        assert entry.token_id == token, where
        assert entry.logprob == pytest.approx(value, abs=TIE), where
        assert 1 + (row > value + TIE).sum() <= entry.rank <= 1 + (row > value - TIE).sum(), where
        assert len(entry.top) in (k, k + 1) and token in entry.top, where
        kth = row.topk(k).values[-1].item() if k else float("inf")
        for t, top_value in entry.top.items():
            assert top_value == pytest.approx(row[t].item(), abs=TIE), where
            assert t == token or row[t].item() >= kth - TIE, where


def test_prompt_logprobs_match_hf_through_chunks_cache_and_sampling(tiny_llama_dir, make_llm):
    # A 16-token step budget cuts every longer prompt into chunks; block size 8 makes each
    # prompt's earlier blocks cacheable for the repeat below.
    llm = make_llm(tiny_llama_dir, block_size=8, num_blocks=512, max_num_batched_tokens=16)
    prompts = parity_prompts(llm.get_tokenizer())[:6]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=3)
    requests = [{"prompt_token_ids": p} for p in prompts]
    baseline = llm.generate(requests, plain)
    # The prompts are cached now: scoring them must compute them again, not read the cache.
    outputs = llm.generate(requests, [scored, plain] * 3)
    for prompt, out, base, params in zip(prompts, outputs, baseline, [scored, plain] * 3,
                                         strict=True):
        # Scoring rows beside the sampling rows change no sampled token.
        assert out.outputs[0].token_ids == base.outputs[0].token_ids
        if params is plain:
            assert out.prompt_logprobs is None
            continue
        assert out.num_cached_tokens == 0
        _check_against_hf(tiny_llama_dir, prompt, out.prompt_logprobs, 3)
    # A one-token prompt: only its None.
    assert outputs[0].prompt_logprobs == [None]


@pytest.mark.parametrize("k", [0, 20])
def test_prompt_logprobs_with_n_and_beam_search(tiny_llama_dir, make_llm, k):
    llm = make_llm(tiny_llama_dir, block_size=8, num_blocks=256)
    prompt = parity_prompts(llm.get_tokenizer())[4]
    for params in (SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4, prompt_logprobs=k),
                   SamplingParams(n=2, beam_width=3, temperature=0, max_tokens=4,
                                  prompt_logprobs=k)):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
        assert len(out.outputs) == params.n
        _check_against_hf(tiny_llama_dir, prompt, out.prompt_logprobs, k)


def test_prompt_logprobs_survive_preemption_by_recompute(tiny_llama_dir, make_llm):
    """A pool too small for every request at once: requests are preempted (some while their
    prompt is half scored) and recomputed; each prompt is still scored once, position by
    position as HF scores it."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    llm = make_llm(tiny_llama_dir, block_size=8, num_blocks=20, max_num_batched_tokens=16,
                   preemption_mode="recompute")
    vocab = llm.get_tokenizer().vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(10, 60))] for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 40), ignore_eos=True,
                             prompt_logprobs=rng.choice([None, 0, 2])) for _ in prompts]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.llm_engine.scheduler.counters.num_preemptions > 0, f"seed {seed}"
    for prompt, out, p in zip(prompts, outputs, params, strict=True):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None, f"seed {seed}"
        else:
            _check_against_hf(tiny_llama_dir, prompt, out.prompt_logprobs, p.prompt_logprobs)


def test_prompt_logprobs_are_checked():
    with pytest.raises(ValueError, match=r"prompt_logprobs must be between 0 and 20, got 21"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an int"):
        SamplingParams(prompt_logprobs=1.5)


def test_scoring_in_slices_gives_each_row_its_own_scores():
    """More rows than one slice: every row scored as a whole-batch log-softmax scores it."""
    from engine_service.model.prompt_logprobs import ROWS_PER_SLICE, score_tokens

    generator = torch.Generator().manual_seed(0)
    rows = 2 * ROWS_PER_SLICE + 7
    logits = torch.randn(rows, 50, generator=generator) * 4
    token_ids = torch.randint(0, 50, (rows,), generator=generator).tolist()
    num_tops = [r % 4 for r in range(rows)]
    scored = score_tokens(logits, token_ids, num_tops)
    reference = logits.log_softmax(dim=-1)
    for r, entry in enumerate(scored):
        row = reference[r]
        assert entry.token_id == token_ids[r]
        assert entry.logprob == pytest.approx(row[token_ids[r]].item(), abs=1e-5)
        assert entry.rank == 1 + int((row > row[token_ids[r]]).sum())
        assert set(entry.top) == set(row.topk(num_tops[r]).indices.tolist()) | {token_ids[r]}


def test_prompt_logprobs_come_with_the_first_token(tiny_llama_dir, make_llm):
    """A 17-token prompt under a 16-token budget: the first step scores every prompt token
    (positions 0-15) but samples nothing (position 16 is next step's): its output carries no
    prompt logprobs; the next one, with the first token, carries them, once."""
    llm = make_llm(tiny_llama_dir, block_size=8, num_blocks=64, max_num_batched_tokens=16)
    engine = llm.llm_engine
    prompt = parity_prompts(llm.get_tokenizer())[5][:17]
    assert len(prompt) == 17
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=3,
                                                   ignore_eos=True, prompt_logprobs=1))
    carried = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = [t for c in out.outputs for t in c.token_ids_delta]
            carried.append((len(out.prompt_logprobs or ()), len(tokens)))
    assert carried[0] == (0, 0)  # all scored, no token yet
    assert carried[1][0] == 17 and carried[1][1] == 1
    assert all(num_scored == 0 for num_scored, _ in carried[2:])


def test_a_step_scores_at_most_its_cap_of_prompt_tokens(tiny_llama_dir, make_llm):
    """A long prompt being scored runs MAX_SCORED_TOKENS_PER_STEP tokens a step (each is a
    vocabulary-sized logits row), while a plain prompt beside it takes the rest of the budget."""
    from engine_service.core.scheduler_output import MAX_SCORED_TOKENS_PER_STEP as CAP

    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=256)
    engine = llm.llm_engine
    rng = random.Random(3)
    vocab = llm.get_tokenizer().vocab_size
    scored_prompt = [rng.randrange(vocab) for _ in range(2 * CAP + 88)]
    plain_prompt = [rng.randrange(vocab) for _ in range(2 * CAP + 88)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("scored", scored_prompt, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1))
    engine.add_request("plain", plain_prompt, params)
    computed, outputs = [], {}
    while engine.has_unfinished_requests():
        before = engine.num_computed_tokens
        for out in engine.step():
            outputs.setdefault(out.request_id, out.prompt_logprobs)
            outputs[out.request_id] = outputs[out.request_id] or out.prompt_logprobs
        computed.append(engine.num_computed_tokens - before)
    assert computed[:3] == [CAP + len(plain_prompt), CAP + 1, 88 + 1]
    _check_against_hf(tiny_llama_dir, scored_prompt, outputs["scored"], 1)
    assert outputs["plain"] is None


def test_a_prompt_waiting_to_be_scored_does_not_hold_back_plain_ones(tiny_llama_dir, make_llm):
    """The step's scored tokens are spent on a long prompt: the short one to be scored behind it
    waits for room, and the plain one behind both runs at once."""
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=512, max_num_batched_tokens=4096)
    engine = llm.llm_engine
    rng = random.Random(5)
    vocab = llm.get_tokenizer().vocab_size
    scored = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    engine.add_request("long", [rng.randrange(vocab) for _ in range(3000)], scored)
    engine.add_request("short", [rng.randrange(vocab) for _ in range(10)], scored)
    engine.add_request("plain", [rng.randrange(vocab) for _ in range(10)],
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    first_token_step: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.outputs[0].token_ids_delta:
                first_token_step.setdefault(out.request_id, step)
    # (the long one, running, takes each step's room until its last chunk: 2,816 tokens in
    # 11 steps, then 184, beside which the short one starts)
    assert first_token_step == {"plain": 1, "long": 12, "short": 12}
