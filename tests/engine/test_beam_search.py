"""Beam search: token-exact with HF `generate(num_beams=...)`, beams share their blocks, a dead
beam's blocks return at once, and preemption or an abort leaves nothing behind.

Every engine here is stepped by `run_checked`, which checks the block invariants after every
step (engine_service/core/invariants.py)."""

from __future__ import annotations

import uuid

import pytest

from engine_service import LLM, BeamSearchParams, SamplingParams
from engine_service.core.engine import LLMEngine
from engine_service.core.outputs import RequestOutput
from tests.engine.prompts import TEXTS
from tests.support.hf_reference import hf_beam_search

MAX_TOKENS = 14
# (length_penalty, early_stopping, min_tokens): HF's three early-stopping modes, length
# penalties that favour long, neutral and short beams, and EOS masked for a while.
TINY_CASES = [(1.0, False, 0), (2.0, True, 0), (0.0, "never", 2), (-0.5, "never", 0)]


def run_checked(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]],
                on_step=lambda step: None) -> list[RequestOutput]:
    """Add the requests, step until all are done with the invariants checked after every step;
    the final outputs in request order. A beam search request must give exactly one output,
    its final one."""
    ids = [uuid.uuid4().hex for _ in requests]
    for request_id, (prompt, params) in zip(ids, requests, strict=True):
        engine.add_request(request_id, prompt, params)
    beam_ids = {i for i, (_, p) in zip(ids, requests, strict=True) if p.use_beam_search}
    finished: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id not in finished
            if output.request_id in beam_ids:
                assert output.finished, "beam search streams only its final beams"
            if output.finished:
                finished[output.request_id] = output
        assert engine.check_block_invariants() == [], f"step {step}"
        on_step(step)
        step += 1
    assert engine.check_block_invariants() == []
    return [finished[i] for i in ids]


def beam_params(k: int, n: int, length_penalty=1.0, early_stopping=False, min_tokens=0,
                stop_token_ids=None, max_tokens=MAX_TOKENS, ignore_eos=False) -> SamplingParams:
    return BeamSearchParams(
        beam_width=k, n=n, max_tokens=max_tokens, length_penalty=length_penalty,
        early_stopping=early_stopping, min_tokens=min_tokens, stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
    ).sampling_params()


def stop_tokens_for(model_dir, prompt: list[int]) -> list[int]:
    """Tokens HF's weaker beams take early on: used as stop tokens, they end some beams (the
    tiny models almost never pick EOS), so finished hypotheses of many lengths compete."""
    beams = hf_beam_search(model_dir, prompt, 8, 8, 10)
    return sorted({tokens[i] for tokens, _ in beams[2:] for i in (2, 4)})[:3]


@pytest.fixture(scope="module")
def tiny_prompts(smollm2_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    # 1 token, a partial first block, and several full blocks (shared by every beam).
    return [tokenizer.encode("Hello")[:1], tokenizer.encode(TEXTS[0]),
            tokenizer.encode(TEXTS[5] + " " + TEXTS[1])]


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_models_match_hf_beam_search(kind, block_size, k, make_llm, request,
                                          tiny_prompts):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    engine = make_llm(model_dir, block_size=block_size, num_blocks=512).llm_engine
    requests, expected = [], []
    for prompt in tiny_prompts:
        stops = stop_tokens_for(model_dir, prompt)
        for length_penalty, early_stopping, min_tokens in TINY_CASES:
            n = k if early_stopping is False else max(1, k // 2)
            requests.append((prompt, beam_params(k, n, length_penalty, early_stopping,
                                                 min_tokens, stops)))
            eos = sorted(engine.eos_token_ids | set(stops))
            expected.append(hf_beam_search(model_dir, prompt, k, n, MAX_TOKENS, length_penalty,
                                           early_stopping, eos, min_tokens))
    # All in one batch: every request's beams step beside the others'.
    outputs = run_checked(engine, requests)
    finish_reasons = set()
    for (prompt, params), out, ref in zip(requests, outputs, expected, strict=True):
        case = f"{len(prompt)}-token prompt, {params}"
        assert [c.token_ids for c in out.outputs] == [tokens for tokens, _ in ref], case
        for c, (tokens, hf_score) in zip(out.outputs, ref, strict=True):
            score = c.cumulative_logprob / len(tokens) ** params.length_penalty
            assert score == pytest.approx(hf_score, abs=1e-3), case
            finish_reasons.add(c.finish_reason)
            if c.finish_reason == "stop":
                assert c.stop_reason == tokens[-1] and tokens[-1] in params.stop_token_ids
            else:
                assert c.finish_reason == "length" and len(tokens) == MAX_TOKENS
    assert finish_reasons == {"stop", "length"}, "the cases must end beams both ways"


@pytest.fixture(scope="module")
def smollm2_cases(smollm2_llm) -> list[tuple[list[int], str]]:
    tokenizer = smollm2_llm.get_tokenizer()
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
        add_generation_prompt=True)
    return [
        (tokenizer.encode(chat, add_special_tokens=False), "chat"),
        (tokenizer.encode(TEXTS[6]), "long"),
    ]


@pytest.fixture(scope="module")
def smollm2_llm_8(smollm2_dir, live_llms: list[LLM]) -> LLM:
    """SmolLM2 on 8-token blocks, loaded once for the module (its pool is checked after each
    test like smollm2_llm's)."""
    llm = LLM(model=str(smollm2_dir), block_size=8, num_blocks=1024, dtype="float32")
    live_llms.append(llm)
    yield llm
    live_llms.remove(llm)


# Widths 2 and 8 (the smallest beam and the widest, whose beams fork most across blocks); 4
# runs on both tiny models at both block sizes. Each width costs an HF beam search on SmolLM2.
@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("block_size", [8, 16])
def test_smollm2_matches_hf_beam_search(k, block_size, smollm2_llm, smollm2_llm_8, smollm2_dir,
                                        smollm2_cases):
    engine = (smollm2_llm if block_size == 16 else smollm2_llm_8).llm_engine
    eos = sorted(engine.eos_token_ids)
    requests = [(prompt, beam_params(k, k, max_tokens=24)) for prompt, _ in smollm2_cases]
    outputs = run_checked(engine, requests)
    reasons = set()
    for (prompt, name), out in zip(smollm2_cases, outputs, strict=True):
        ref = hf_beam_search(smollm2_dir, prompt, k, k, 24, eos_token_ids=eos)
        assert [c.token_ids for c in out.outputs] == [t for t, _ in ref], name
        scores = [c.cumulative_logprob / len(c.token_ids) for c in out.outputs]
        assert scores == pytest.approx([s for _, s in ref], abs=1e-3), name
        assert scores == sorted(scores, reverse=True)
        reasons |= {c.finish_reason for c in out.outputs}
    assert "stop" in reasons, "the chat answer should end with EOS"
    chat_out = outputs[0].outputs[0]
    assert "Paris" in chat_out.text and chat_out.token_ids[-1] in engine.eos_token_ids


def test_beams_share_blocks_and_dead_beams_free_theirs(make_llm, tiny_llama_dir):
    """A 40-token prompt (2 full blocks of 16 + 8) searched with 4 beams: the full prompt blocks
    exist once for all beams, the partial one is shared until written, and the blocks held are
    always the distinct blocks of the live beams' tables (a dead beam's are back in the pool).
    Checked after each step, i.e. after its beam step (forks share everything)."""
    engine = make_llm(tiny_llama_dir, block_size=16, num_blocks=128,
                      enable_prefix_caching=False).llm_engine
    prompt = list(range(300, 340))
    params = beam_params(4, 2, max_tokens=30, ignore_eos=True)
    group = None
    peak_distinct = peak_unshared = 0

    def check(step: int) -> None:
        nonlocal group, peak_distinct, peak_unshared
        if not engine.scheduler.running:
            return
        group = engine.scheduler.running[0]
        tables = [engine.kv.block_table(s) for s in group.live_seqs()]
        distinct = {b for t in tables for b in t}
        held = engine.pool.num_blocks - engine.pool.num_free_blocks
        assert held == len(distinct), f"step {step}: blocks held beyond the live beams"
        assert len(tables) == 4
        assert all(t[:2] == tables[0][:2] for t in tables), "prompt blocks shared"
        assert [engine.pool.blocks[b].ref_count for b in tables[0][:2]] == [4, 4]
        if step == 0:
            # Just forked: the partial prompt block too is shared, nothing is copied yet.
            assert len(distinct) == 3
        peak_distinct = max(peak_distinct, len(distinct))
        peak_unshared = max(peak_unshared, sum(len(t) for t in tables))

    [out] = run_checked(engine, [(prompt, params)], check)
    assert [len(c.token_ids) for c in out.outputs] == [30, 30]
    assert peak_distinct <= engine.blocks_for_request(len(prompt), params)
    assert peak_distinct < peak_unshared
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_beam_requests_mixed_with_sampled_ones_match_each_alone(make_llm, tiny_llama_dir,
                                                               tiny_prompts):
    engine = make_llm(tiny_llama_dir, block_size=8, num_blocks=512).llm_engine
    requests = [
        (tiny_prompts[1], beam_params(4, 2)),
        (tiny_prompts[2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
        (tiny_prompts[2], beam_params(8, 8, early_stopping=True)),
        (tiny_prompts[0], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=9,
                                         ignore_eos=True)),
        (tiny_prompts[0], beam_params(2, 1, length_penalty=0.5)),
    ]
    together = run_checked(engine, requests)
    for request, out in zip(requests, together, strict=True):
        [alone] = run_checked(engine, [request])
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(
            [c.cumulative_logprob for c in alone.outputs], abs=1e-4)


def test_abort_mid_search_frees_every_block(make_llm, tiny_llama_dir, tiny_prompts):
    engine = make_llm(tiny_llama_dir, block_size=8, num_blocks=256).llm_engine
    free_at_start = engine.pool.num_free_blocks
    engine.add_request("beam", tiny_prompts[2], beam_params(8, 3, max_tokens=40,
                                                            ignore_eos=True))
    engine.add_request("other", tiny_prompts[1], SamplingParams(temperature=0, max_tokens=40))
    for _ in range(6):
        outputs = engine.step()
        assert all(o.request_id != "beam" for o in outputs), "no output before the end"
        assert engine.check_block_invariants() == []
    [group] = [g for g in engine.scheduler.running if g.request_id == "beam"]
    assert len(group.live_seqs()) == 8
    out = engine.abort_request("beam")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    # The best running beams so far: one token per step (the first step's prefill gave one).
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert engine.check_block_invariants() == []
    engine.abort_request("other")
    assert engine.check_block_invariants() == []
    assert engine.pool.num_free_blocks == free_at_start


BEAM_REQUESTS = [  # (prompt index, beam width, n)
    (2, 4, 4), (1, 8, 2), (0, 4, 1), (2, 2, 2),
]


@pytest.fixture(scope="module")
def roomy_beams(tiny_llama_dir, tiny_prompts):
    from engine_service import LLM

    engine = LLM(str(tiny_llama_dir), block_size=8, num_blocks=1024, dtype="float32").llm_engine
    requests = [(tiny_prompts[p], beam_params(k, n, max_tokens=24, ignore_eos=True))
                for p, k, n in BEAM_REQUESTS]
    return requests, run_checked(engine, requests)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 20])
def test_preempted_beam_groups_give_the_same_beams(mode, max_num_batched_tokens, make_llm,
                                                   tiny_llama_dir, roomy_beams):
    """Four beam requests in a pool the size of the largest one's worst-case peak: groups are
    preempted as a whole (recompute: every beam recomputed, the prompt shared again; swap),
    and a 20-token budget prefills and recomputes in chunks, beams waiting for a step with
    room for all of them. Same beams as a roomy pool."""
    requests, expected = roomy_beams
    probe = make_llm(tiny_llama_dir, block_size=8, num_blocks=1024).llm_engine
    biggest = max(probe.blocks_for_request(len(p), params) for p, params in requests)
    from tests.engine.test_preemption import llm_block_bytes

    engine = make_llm(tiny_llama_dir, block_size=8, num_blocks=biggest,
                      preemption_mode=mode, swap_space=64 * llm_block_bytes(tiny_llama_dir),
                      max_num_batched_tokens=max_num_batched_tokens).llm_engine
    outputs = run_checked(engine, requests)
    for out, want in zip(outputs, expected, strict=True):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(
            [c.cumulative_logprob for c in want.outputs], abs=1e-3)
    counters = engine.scheduler.counters
    assert counters.num_preemptions > 0
    assert (counters.num_swapped_out if mode == "swap" else counters.num_recomputed) > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_offline_beam_search_returns_best_beams_first(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=256)
    prompts = ["The capital of France is", {"prompt": "Once upon a time"}]
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=8,
                                                        ignore_eos=True))
    assert len(outputs) == 2
    tokenizer = llm.get_tokenizer()
    for out in outputs:
        assert len(out.sequences) == 4  # n defaults to beam_width, as in vLLM
        scores = [s.cum_logprob / len(s.token_ids) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(s.token_ids) for s in out.sequences}) == 4
        for s in out.sequences:
            assert len(s.token_ids) == 8 and s.finish_reason == "length"
            assert s.text == tokenizer.decode(s.token_ids, skip_special_tokens=True)


def test_beam_search_is_validated(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=8, num_blocks=40, max_num_seqs=16)
    prompt = {"prompt_token_ids": list(range(10, 30))}
    with pytest.raises(ValueError, match=r"beam_width must be at most 16 on this engine"):
        llm.beam_search(prompt, BeamSearchParams(beam_width=32, max_tokens=4))
    # 20 prompt tokens + 40: 8 blocks per beam, 2 of them shared: 2 + 8 * 6 = 50 > 40 blocks.
    with pytest.raises(ValueError, match=r"needs up to 50 KV blocks .* beam_width=8"):
        llm.beam_search(prompt, BeamSearchParams(beam_width=8, max_tokens=40))
    with pytest.raises(ValueError, match=r"temperature must be 0 with beam search"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match=r"n must be at most beam_width \(2\)"):
        BeamSearchParams(beam_width=2, max_tokens=4, n=3)
    with pytest.raises(ValueError, match=r"beam_width must be between 1 and 64, got 0"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match=r"early_stopping must be one of True, False or "):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    with pytest.raises(ValueError, match=r"stop must be left unset with beam search"):
        SamplingParams(temperature=0, beam_width=2, stop=["."])
    with pytest.raises(ValueError, match=r"logprobs must be left unset with beam search"):
        SamplingParams(temperature=0, beam_width=2, logprobs=1)
    with pytest.raises(ValueError, match=r"length_penalty and early_stopping must be left"):
        SamplingParams(length_penalty=2.0)
    # Nothing was left behind by the refused requests; a fitting one runs.
    assert llm.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=8))[0].sequences


def test_strongly_negative_length_penalty_still_returns_n_beams(make_llm, tiny_llama_dir):
    """A finished beam scored below HF's -1e9 sentinel (-20 / 12 ** -8 is about -8.6e9) must
    still be kept: the search returned no beams at all. Without a stop token every beam ends at
    max_tokens, so the length penalty cannot change which beams win: the same beams as HF with
    length_penalty 1, each scored cum_logprob / 12 ** -8."""
    engine = make_llm(tiny_llama_dir, block_size=8, num_blocks=256).llm_engine
    prompt = [5, 6, 7, 8, 9]
    [out] = run_checked(engine, [(prompt, beam_params(4, 4, length_penalty=-8.0,
                                                      max_tokens=12, ignore_eos=True))])
    ref = hf_beam_search(tiny_llama_dir, prompt, 4, 4, 12, 1.0)
    assert [c.token_ids for c in out.outputs] == [tokens for tokens, _ in ref]
    assert [c.cumulative_logprob / 12 for c in out.outputs] == pytest.approx(
        [score for _, score in ref], abs=1e-3)
    assert all(c.finish_reason == "length" for c in out.outputs)


def test_length_penalty_that_overflows_the_scores_is_refused(make_llm, tiny_llama_dir):
    """2 ** 2000 overflows (Python's pow raised OverflowError inside the engine step, which
    kills a server's engine thread); 12 ** -40 underflows float32 (every score -inf). Refused
    up front, naming the field, the allowed range and the value; the engine keeps serving."""
    llm = make_llm(tiny_llama_dir, block_size=8, num_blocks=256)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=r"length_penalty must be between -9\.59 and 9\.59 for "
                                         r"beams of up to 1341 tokens .* got 2000\.0"):
        llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=1341,
                                                 length_penalty=2000.0))
    with pytest.raises(ValueError, match=r"length_penalty must be between -27\.79 and 27\.79 .* "
                                         r"got -40\.0"):
        llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=12,
                                                 length_penalty=-40.0))
    # One generated token: 1 ** anything is 1, any length penalty is fine.
    [out] = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=1,
                                                     length_penalty=2000.0))
    assert len(out.sequences) == 2
    [out] = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=12,
                                                     length_penalty=-27.0, ignore_eos=True))
    assert [len(s.token_ids) for s in out.sequences] == [12, 12]
