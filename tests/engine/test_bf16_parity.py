"""bfloat16 end to end (weights, KV cache, activations) against HF transformers in bfloat16: the
engine's default dtype on CPUs with AVX512-BF16 or AMX (dtype="auto"), and what it runs
elsewhere when asked (slower there, but the same numbers to check). Compared the way vLLM
compares lower precision, with the logprobs bounded (tests/support/logprobs_close.py): greedy
decoding, the top-k logprobs, seeded n > 1 sampling and beam search, on SmolLM2 and the tiny
models. The float32 parity tests (test_hf_parity.py, test_beam_search.py) stay exact.

Where the outputs are not greedy (sampled tokens, beams), HF cannot produce the same ones: our
outputs are teacher-forced through HF instead (one forward pass over prompt + output) and each
of our tokens and logprobs checked against HF's distribution at the same context."""

import pytest
import torch

from engine_service import LLM, BeamSearchParams, SamplingParams
from tests.engine.prompts import TEXTS, parity_prompts
from tests.support.hf_reference import (
    hf_beam_search,
    hf_greedy_top_logprobs,
    hf_teacher_forced_logprobs,
)
from tests.support.logprobs_close import (
    LogprobDiffs,
    LogprobTolerance,
    check_logprobs_close,
    check_top_logprobs,
)

TOP_K = 5
KINDS = ["smollm2", "tiny_llama", "tiny_qwen2"]
# Bounds on |ours - HF| (tests/support/logprobs_close.py) per model: bf16 logits keep 8
# significant bits, so the noise follows the model's logit scale. Measured on an AMX CPU over
# these tests' comparisons (and more prompts), worst logprob / worst test mean / worst beam
# score:
#   SmolLM2 (logits ~20-30, bf16 spacing 0.125-0.25, 30 layers): 0.56 (a rank-5 logprob; the
#     greedy and sampled tokens' worst 0.24 and 0.38, HF's own generate vs one forward pass
#     0.28) / 0.065 / 0.021;
#   tiny models (logits ~4-8, spacing 1/32): 0.047 (1.5 spacings) / 0.008 / 0.007.
# Engine mutants (patched in, not committed) fail them: RoPE theta x2 (SmolLM2: worst 2.86,
# mean 0.16, beam scores off by up to 0.06; tiny Llama: 1.03, 0.11) fails all 15 closeness
# tests below, attention scale x1.1 (2.0, 0.21; 0.43, 0.05) 14; even x1.02 (0.74, 0.08; 0.14,
# 0.014) fails 4.
TOLERANCES = {
    "smollm2": LogprobTolerance(max_diff=0.7, mean_diff=0.1, score_diff=0.03),
    "tiny_llama": LogprobTolerance(max_diff=0.07, mean_diff=0.015, score_diff=0.01),
    "tiny_qwen2": LogprobTolerance(max_diff=0.07, mean_diff=0.015, score_diff=0.01),
    "tiny_qwen3": LogprobTolerance(max_diff=0.07, mean_diff=0.015, score_diff=0.01),
}


@pytest.fixture(scope="module")
def bf16_llm(request, live_llms: list[LLM]):
    """kind -> (a bfloat16 LLM at block size 16, its model directory), built once per module
    and checked after every test like the other shared engines (tests/engine/conftest.py)."""
    built: dict[str, tuple[LLM, object]] = {}

    def get(kind: str) -> tuple[LLM, object]:
        if kind not in built:
            model_dir = request.getfixturevalue(f"{kind}_dir")
            llm = LLM(model=str(model_dir), dtype="bfloat16", block_size=16, num_blocks=256)
            assert llm.llm_engine.runner.kv_caches.dtype == torch.bfloat16
            live_llms.append(llm)
            built[kind] = (llm, model_dir)
        return built[kind]

    yield get
    for llm, _ in built.values():
        live_llms.remove(llm)


def short_prompts(llm: LLM) -> list[list[int]]:
    """A partial first block, and two full blocks (shared by every sample or beam)."""
    tokenizer = llm.get_tokenizer()
    return [tokenizer.encode(TEXTS[0]), tokenizer.encode(TEXTS[5] + " " + TEXTS[1])]


def sampled(seed: int) -> SamplingParams:
    """4 samples of 16 tokens, each drawn from the top 3, with the top-5 logprobs."""
    return SamplingParams(n=4, temperature=1.0, top_k=3, seed=seed, max_tokens=16,
                          ignore_eos=True, logprobs=TOP_K)


def top_k_of(row: torch.Tensor, k: int = TOP_K) -> dict[int, float]:
    values, ids = row.topk(k)
    return dict(zip(ids.tolist(), values.tolist(), strict=True))


# The real model at the engine's default block size; the tiny ones (seconds, not minutes, on a
# CPU) at two, so a block boundary inside the prompt and the output is crossed both ways.
@pytest.mark.parametrize(("kind", "max_tokens", "block_size"), [
    ("smollm2", 24, 16),
    ("tiny_llama", 24, 8), ("tiny_llama", 24, 16),
    ("tiny_qwen2", 24, 8), ("tiny_qwen2", 24, 16),
    ("tiny_qwen3", 24, 16),
])
def test_bf16_greedy_is_close_to_hf_bf16(kind, max_tokens, block_size, make_llm, request):
    """Both greedy: vLLM's rule, and every top-k logprob before (and at) the first difference
    within the bound."""
    model_dir = request.getfixturevalue(f"{kind}_dir")
    llm = make_llm(model_dir, dtype="bfloat16", block_size=block_size, num_blocks=512)
    assert llm.llm_engine.runner.kv_caches.dtype == torch.bfloat16
    prompts = parity_prompts(llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    diffs = LogprobDiffs(TOLERANCES[kind])
    matched = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ours = [(e.token_id, e.top) for e in out.outputs[0].logprobs]
        reference = hf_greedy_top_logprobs(model_dir, prompt, max_tokens, torch.bfloat16, TOP_K)
        first = check_logprobs_close(ours, reference, diffs, f"{len(prompt)}-token prompt")
        matched += max_tokens if first is None else first
    # Not vacuous: most positions were compared with identical contexts on both sides.
    assert matched >= len(prompts) * max_tokens // 2, matched
    diffs.check_mean(min_count=matched * TOP_K // 2)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_top_logprobs_match_hf_teacher_forced(kind, bf16_llm):
    """Our greedy outputs teacher-forced through HF: at every position (past any point where
    HF's own greedy run would have gone another way), our top-k logprobs are HF's top-k up to
    near-ties, each within the bound."""
    llm, model_dir = bf16_llm(kind)
    prompts = parity_prompts(llm.get_tokenizer())[::4]  # 1, 7 and 306 tokens
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    diffs = LogprobDiffs(TOLERANCES[kind])
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        rows = hf_teacher_forced_logprobs(model_dir, prompt, completion.token_ids,
                                          torch.bfloat16)
        for i, (entry, row) in enumerate(zip(completion.logprobs, rows, strict=True)):
            assert entry.rank == 1 and entry.top[entry.token_id] == entry.logprob
            check_top_logprobs(entry.top, row, TOP_K, diffs,
                               f"{len(prompt)}-token prompt, position {i}")
    diffs.check_mean(min_count=len(prompts) * 16 * TOP_K)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_seeded_samples_are_close_to_hf_teacher_forced(kind, bf16_llm):
    """n=4 samples from the top 3 (so each sampled token is in HF's top 5 for a correct engine,
    near-ties included), teacher-forced through HF: each sampled token in HF's top 5, our
    logprobs (the sampled token's and the top-k) within the bound."""
    llm, model_dir = bf16_llm(kind)
    prompts = short_prompts(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampled(seed=1234))
    diffs = LogprobDiffs(TOLERANCES[kind])
    for prompt, out in zip(prompts, outputs, strict=True):
        # Not all one sample (a peaked continuation may well repeat some).
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "the samples should differ"
        for c in out.outputs:
            rows = hf_teacher_forced_logprobs(model_dir, prompt, c.token_ids, torch.bfloat16)
            for i, (entry, row) in enumerate(zip(c.logprobs, rows, strict=True)):
                where = f"{len(prompt)}-token prompt, sample {c.index}, position {i}"
                assert entry.token_id in top_k_of(row), f"{where}: {entry} vs HF {top_k_of(row)}"
                assert entry.rank <= 3, f"{where}: sampled outside top_k=3: {entry}"
                check_top_logprobs(entry.top, row, TOP_K, diffs, where)
    diffs.check_mean(min_count=len(prompts) * 4 * 16 * TOP_K)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_seeded_samples_reproduce_in_other_batches(kind, bf16_llm):
    """A seed gives the same n=4 samples and logprobs alone and beside other requests (in other
    batch rows, its prompt's blocks cached by then); another seed gives other samples. Only
    where the bf16 linears are ours: oneDNN's results depend on the batch's shape."""
    from engine_service.model.models.packed_linear import bf16_linear_kernel

    if bf16_linear_kernel() not in ("amx", "vdpbf16ps"):
        pytest.skip(f"bf16 linears run on {bf16_linear_kernel()} here, which depends on the "
                    "batch: seeded samples may differ between batches")
    llm, _ = bf16_llm(kind)
    prompts = [{"prompt_token_ids": p} for p in short_prompts(llm)]

    def samples(out):
        return [(c.token_ids, [e.logprob for e in c.logprobs]) for c in out.outputs]

    alone = [samples(llm.generate(p, sampled(seed=99))[0]) for p in prompts]
    others = SamplingParams(n=2, temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate([prompts[1], {"prompt_token_ids": [5, 6, 7]}, prompts[0]],
                         [sampled(seed=99), others, sampled(seed=99)])
    assert [samples(batch[2]), samples(batch[0])] == alone
    assert samples(llm.generate(prompts[1], sampled(seed=98))[0]) != alone[1]


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_beam_search_is_close_to_hf_bf16(kind, bf16_llm):
    """Beam search amplifies rounding: a near-tie early on sends either search down other beams
    (HF's float32 and bfloat16 searches part ways too), so the beams are not compared token for
    token. Instead, with 4 beams, no EOS and length penalty 1 (score = cumulative logprob /
    length):
    - each of our beams, teacher-forced through HF: each token in HF's top 5 (a surviving beam's
      token is in its own model's top 4), and its score HF's within the score bound;
    - a beam HF's bfloat16 search also returned scores the same there, within the score bound;
    - the best beams by vLLM's rule: equal until the first difference, where each token is in
      the other's top 5 at that (identical) context, both logprobs within the bound."""
    llm, model_dir = bf16_llm(kind)
    tolerance = TOLERANCES[kind]
    prompts = short_prompts(llm)
    width, max_tokens = 4, 16
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                              BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                               ignore_eos=True))
    diffs = LogprobDiffs(tolerance)
    num_shared = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        case = f"{len(prompt)}-token prompt"
        ours = [(s.token_ids, s.cum_logprob / len(s.token_ids)) for s in out.sequences]
        assert [len(tokens) for tokens, _ in ours] == [max_tokens] * width, case
        for tokens, score in ours:
            rows = hf_teacher_forced_logprobs(model_dir, prompt, tokens, torch.bfloat16)
            for i, (token, row) in enumerate(zip(tokens, rows, strict=True)):
                assert token in top_k_of(row), f"{case}, beam {tokens}, position {i}"
            hf_score = rows.gather(1, torch.tensor(tokens).unsqueeze(1)).mean().item()
            assert score == pytest.approx(hf_score, abs=tolerance.score_diff), (case, tokens)

        reference = hf_beam_search(model_dir, prompt, width, width, max_tokens,
                                   dtype=torch.bfloat16)
        hf_scores = {tuple(tokens): score for tokens, score in reference}
        for tokens, score in ours:
            if tuple(tokens) in hf_scores:
                num_shared += 1
                assert score == pytest.approx(hf_scores[tuple(tokens)],
                                              abs=tolerance.score_diff), (case, tokens)

        best, hf_best = ours[0][0], reference[0][0]
        first = next((i for i, (a, b) in enumerate(zip(best, hf_best, strict=True)) if a != b),
                     None)
        if first is not None:
            context = prompt + best[:first]
            [here] = llm.generate({"prompt_token_ids": context},
                                  SamplingParams(temperature=0, max_tokens=1, logprobs=TOP_K))
            hf_row = hf_teacher_forced_logprobs(model_dir, prompt, hf_best[: first + 1],
                                                torch.bfloat16)[first]
            assert check_logprobs_close(
                [(best[first], here.outputs[0].logprobs[0].top)],
                [(hf_best[first], top_k_of(hf_row))], diffs, f"{case}, best beams at {first}",
            ) == 0
    # Not vacuous: HF's search returned some of the very beams ours did.
    assert num_shared >= 2, num_shared
