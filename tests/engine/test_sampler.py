"""Sampler: greedy/penalties/min_tokens against a plain per-row reference, sampling filters and
distributions, seeded reproducibility independent of the batch, raw logprobs."""

import math

import pytest
import torch

from engine_service.model.sampler import NUCLEUS_CANDIDATES, Sampler, SamplingRow, make_generator
from engine_service.model.sampling_params import SamplingParams

EOS = 0


def row(params: SamplingParams, prompt=(), output=(), generator=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), generator)


def reference_processed(logits: torch.Tensor, r: SamplingRow, eos: set[int]) -> torch.Tensor:
    """logit_bias, vLLM's penalties and min_tokens masking, written the slow obvious way for
    one row."""
    out = logits.clone()
    p = r.params
    for token, bias in p.logit_bias.items():
        out[token] += bias
    for token in set(r.prompt_token_ids) | set(r.output_token_ids):
        if out[token] > 0:
            out[token] /= p.repetition_penalty
        else:
            out[token] *= p.repetition_penalty
    for token in set(r.output_token_ids):
        count = r.output_token_ids.count(token)
        out[token] -= p.frequency_penalty * count + p.presence_penalty
    if len(r.output_token_ids) < p.min_tokens:
        for token in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            out[token] = -math.inf
    return out


def test_all_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = torch.randn(5, 100)
    before = logits.clone()
    result = Sampler(100, {EOS})(logits, [row(SamplingParams(temperature=0))] * 5)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 5
    assert torch.equal(logits, before)


def test_greedy_with_penalties_and_min_tokens_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, num_rows = 60, 40
    rows = []
    for i in range(num_rows):
        params = SamplingParams(
            temperature=0,
            repetition_penalty=[1.0, 1.3, 0.7, 2.0][i % 4],
            presence_penalty=[0.0, 0.5, -0.4][i % 3],
            frequency_penalty=[0.0, 0.3, -1.0, 1.5][i % 4],
            max_tokens=None,
            min_tokens=[0, 3, 50][i % 3],
            stop_token_ids=[5, 6] if i % 2 else None,
            ignore_eos=i % 5 == 0,
            # A bias may lift a token past EOS or bury the best one; some rows have none.
            logit_bias=[None, {3: 9.5}, {EOS: -100.0, 11: 2.0}, {7: 1.5, 8: -3.0}][i % 4],
        )
        prompt = torch.randint(0, vocab, (i % 7,), generator=gen).tolist()
        output = torch.randint(0, 12, (i % 9,), generator=gen).tolist()  # repeats: counts > 1
        rows.append(row(params, prompt, output))
    # Logits on a coarse grid around 0 so penalties flip the argmax often; noise breaks ties.
    logits = torch.randint(-3, 4, (num_rows, vocab), generator=gen).float()
    logits += torch.rand(num_rows, vocab, generator=gen) * 1e-3
    logits[:, EOS] = 10.0  # EOS wins unless min_tokens masks it
    result = Sampler(vocab, {EOS})(logits, rows)
    expected = [
        reference_processed(logits[i], r, {EOS}).argmax().item() for i, r in enumerate(rows)
    ]
    assert result.token_ids == expected
    changed = sum(t != a for t, a in zip(expected, logits.argmax(dim=-1).tolist(), strict=True))
    assert changed > num_rows // 3  # the penalties and masks really did something here


def test_min_tokens_masks_eos_and_stop_ids_but_ignore_eos_keeps_eos() -> None:
    logits = torch.zeros(3, 10)
    logits[:, EOS] = 5.0
    logits[:, 7] = 4.0
    logits[:, 3] = 3.0
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7])
    rows = [
        row(p, output=[1]),  # still short: EOS and 7 masked
        row(p, output=[1, 1]),  # long enough: EOS allowed
        row(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), output=[1]),
    ]
    assert Sampler(10, {EOS})(logits, rows).token_ids == [3, EOS, EOS]


def test_logit_bias_moves_only_its_rows_and_leaves_logprobs_raw() -> None:
    logits = torch.zeros(3, 10)
    logits[:, 4] = 5.0
    plain = SamplingParams(temperature=0, logprobs=1)
    rows = [
        row(SamplingParams(temperature=0, logprobs=1, logit_bias={9: 100.0})),  # forced
        row(plain),
        row(SamplingParams(temperature=0, logprobs=1, logit_bias={4: -100.0, 2: 0.5})),
    ]
    result = Sampler(10, {EOS})(logits, rows)
    assert result.token_ids == [9, 4, 2]
    raw = logits[0].log_softmax(-1)
    # The sampled token's logprob is the model's own, as the other penalties leave it.
    assert result.logprobs[0].logprob == pytest.approx(raw[9].item())
    # Sampled rows too: a banned token is never drawn, a forced one always is.
    draws = Sampler(10, {EOS}, seed=0)(logits[0].expand(500, 10).contiguous(), [
        row(SamplingParams(temperature=1.0, logit_bias={4: -100.0}))] * 250 + [
        row(SamplingParams(temperature=1.0, top_k=3, logit_bias={6: 100.0}))] * 250)
    assert 4 not in draws.token_ids[:250] and set(draws.token_ids[250:]) == {6}


def test_padded_vocab_columns_are_never_chosen() -> None:
    logits = torch.zeros(2, 12)
    logits[:, 10:] = 100.0  # beyond the tokenizer's 10 tokens: embedding padding
    rows = [row(SamplingParams(temperature=0)), row(SamplingParams(top_k=5, seed=1))]
    assert all(t < 10 for t in Sampler(10, {EOS})(logits, rows).token_ids)


def test_bad_logits_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="len\\(rows\\)=2"):
        Sampler(10, {EOS})(torch.zeros(3, 10), [row(SamplingParams())] * 2)
    with pytest.raises(ValueError, match="fewer than vocab size 10"):
        Sampler(10, {EOS})(torch.zeros(1, 8), [row(SamplingParams())])


def frequencies(logits: torch.Tensor, params: SamplingParams, draws: int = 8000) -> torch.Tensor:
    """Empirical next-token distribution: one batch of `draws` identical rows."""
    vocab = logits.shape[0]
    tokens = Sampler(vocab, {EOS}, seed=0)(logits.expand(draws, vocab), [row(params)] * draws)
    return torch.bincount(torch.tensor(tokens.token_ids), minlength=vocab).float() / draws


def test_temperature_samples_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for temperature in (0.5, 1.0, 2.0):
        observed = frequencies(logits, SamplingParams(temperature=temperature))
        expected = (logits / temperature).softmax(dim=-1)
        torch.testing.assert_close(observed, expected, atol=0.02, rtol=0)


def test_top_k_top_p_min_p_renormalize_over_the_kept_tokens() -> None:
    logits = torch.log(torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01]))
    cases = [
        (SamplingParams(top_k=3), [0.35, 0.25, 0.15]),
        (SamplingParams(top_p=0.7), [0.35, 0.25, 0.15]),  # 0.6 < 0.7: the third is needed
        (SamplingParams(top_p=0.6), [0.35, 0.25]),
        (SamplingParams(min_p=0.3), [0.35, 0.25, 0.15]),  # p >= 0.105
        # top-p on the top-k-renormalized distribution: 0.35/0.85 + 0.25/0.85 = 0.706 >= 0.7
        (SamplingParams(top_k=4, top_p=0.7), [0.35, 0.25]),
        (SamplingParams(top_k=1), [1.0]),
    ]
    for params, kept in cases:
        expected = torch.zeros(8)
        expected[: len(kept)] = torch.tensor(kept) / sum(kept)
        observed = frequencies(logits, params)
        torch.testing.assert_close(observed, expected, atol=0.02, rtol=0, msg=str(params))


def test_wide_nucleus_falls_back_to_the_whole_vocabulary() -> None:
    # A flat distribution: top_p=0.5 keeps half of 3000 tokens, more than the first candidate
    # widths (64, 1024): the row is redone until the candidates are the whole vocabulary.
    vocab = 3000
    assert NUCLEUS_CANDIDATES[1] < vocab // 2 and NUCLEUS_CANDIDATES[2] >= vocab
    logits = -torch.arange(vocab, dtype=torch.float32) * 1e-4  # gently decreasing
    observed = frequencies(logits, SamplingParams(top_p=0.5), draws=1500)
    nucleus = int((logits.softmax(-1).cumsum(-1) < 0.5).sum()) + 1
    assert observed[nucleus:].sum() == 0
    # Drawn evenly from all over the nucleus, not just from the first candidates.
    assert observed[: nucleus // 2].sum().item() == pytest.approx(0.5, abs=0.06)
    assert observed[nucleus - 100 : nucleus].sum() > 0


@pytest.mark.parametrize(
    ("seeded", "scale"),
    [
        (SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234), 3.0),
        (SamplingParams(top_p=0.9, seed=5), 0.05),  # flat: the nucleus needs widening
        (SamplingParams(temperature=0.7, min_p=0.05, seed=6), 3.0),  # whole-vocabulary path
    ],
)
def test_seeded_row_gives_the_same_tokens_alone_or_in_any_batch(
    seeded: SamplingParams, scale: float
) -> None:
    vocab, steps = 1500, 12
    step_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(3)) * scale

    def run(batch_mates: list[SamplingParams], mate_first: bool) -> list[int]:
        sampler = Sampler(vocab, {EOS})
        generator = make_generator(seeded.seed, 0, "cpu")
        tokens = []
        for s in range(steps):
            rows = [row(seeded, output=tokens, generator=generator)]
            mates = [row(p, generator=None) for p in batch_mates]
            rows = mates + rows if mate_first else rows + mates
            logits = torch.randn(len(rows), vocab) * 3  # batch mates: arbitrary logits
            logits[0 if not mate_first else len(mates)] = step_logits[s]
            result = sampler(logits, rows)
            tokens.append(result.token_ids[len(mates) if mate_first else 0])
        return tokens

    alone = run([], mate_first=False)
    # Batch mates that change every path: greedy, a wide top-k, top-p needing the fallback.
    mates = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=700),
        SamplingParams(top_p=0.99, min_p=0.01),
        SamplingParams(temperature=1.5),
    ]
    assert run(mates, mate_first=True) == alone
    assert run(mates[1:3], mate_first=False) == alone
    assert len(set(alone)) > 3  # really sampled, not a constant


def test_generators_differ_across_sequences_and_reproduce_per_seed() -> None:
    def draws(seed: int, index: int) -> list[float]:
        return torch.rand(4, generator=make_generator(seed, index, "cpu")).tolist()

    assert draws(7, 0) == draws(7, 0)
    assert draws(7, 0) != draws(7, 1)
    assert draws(7, 1) != draws(8, 0)  # seeds and indices are mixed, not added
    assert draws(-(2**63), 3) != draws(2**64 - 1, 3)


def test_n_parallel_seeded_sequences_differ() -> None:
    vocab, n = 1000, 4
    params = SamplingParams(n=n, seed=99)
    logits = torch.zeros(n, vocab)  # uniform: any repeat would be a shared stream
    rows = [row(params, generator=make_generator(99, i, "cpu")) for i in range(n)]
    tokens = Sampler(vocab, {EOS})(logits, rows).token_ids
    assert len(set(tokens)) == n


def test_logprobs_are_of_the_raw_distribution() -> None:
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5))
    rows = [
        row(SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0), prompt=[1, 2]),
        row(
            SamplingParams(temperature=0.3, top_k=5, logprobs=0, seed=3),
            generator=make_generator(3, 0, "cpu"),
        ),
        row(SamplingParams(temperature=0)),  # asked for none
    ]
    result = Sampler(vocab, {EOS})(logits, rows)
    raw = logits.log_softmax(dim=-1)
    first, second, third = result.logprobs
    assert third is None
    assert first is not None and second is not None

    token = result.token_ids[0]
    assert first.token_id == token
    assert first.logprob == pytest.approx(raw[0, token].item(), abs=1e-6)
    best3 = raw[0].topk(3)
    expected_top = dict(zip(best3.indices.tolist(), best3.values.tolist(), strict=True))
    expected_top[token] = raw[0, token].item()
    assert first.top == pytest.approx(expected_top, abs=1e-6)
    assert first.rank == int((raw[0] > raw[0, token]).sum()) + 1

    token = result.token_ids[1]
    assert second.top == pytest.approx({token: raw[1, token].item()}, abs=1e-6)  # logprobs=0


def test_allowed_token_ids_mask_only_their_rows_and_leave_logprobs_raw() -> None:
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(4, vocab)
    allowed = (3, 17, 41)
    rows = [row(SamplingParams(temperature=0, logprobs=1, allowed_token_ids=allowed)),
            row(SamplingParams(temperature=0)),
            row(SamplingParams(temperature=0, allowed_token_ids=allowed,
                               logit_bias={41: 100.0, 5: 100.0})),  # 5: biased, not allowed
            row(SamplingParams(temperature=0, allowed_token_ids=[8]))]
    out = Sampler(vocab, {EOS})(logits, rows)
    best_allowed = max(allowed, key=lambda t: logits[0, t].item())
    assert out.token_ids == [best_allowed, logits[1].argmax().item(), 41, 8]
    # The sampled token's logprob is the model's own (raw), as with logit_bias.
    assert out.logprobs[0].logprob == pytest.approx(
        torch.log_softmax(logits[0], -1)[best_allowed].item(), abs=1e-5)
    # Sampled rows draw among the allowed tokens alone, by their own odds.
    draws = Sampler(vocab, {EOS})(torch.zeros(600, vocab), [row(SamplingParams(
        temperature=1.0, allowed_token_ids=allowed))] * 600).token_ids
    assert set(draws) == set(allowed)


def test_min_tokens_holds_back_allowed_stops_unless_only_stops_are_allowed() -> None:
    """An empty row has no token to draw: where every allowed token stops the output,
    min_tokens gives way (as it does to a grammar)."""
    logits = torch.zeros(3, 20)
    logits[:, EOS] = 5.0
    rows = [row(SamplingParams(temperature=0, min_tokens=4, allowed_token_ids=[EOS, 7])),
            row(SamplingParams(temperature=0, min_tokens=4, allowed_token_ids=[EOS, 9],
                               stop_token_ids=[9])),
            row(SamplingParams(temperature=1.0, min_tokens=4, allowed_token_ids=[EOS]))]
    assert Sampler(20, {EOS})(logits, rows).token_ids == [7, EOS, EOS]


def test_bad_words_read_by_index_ban_what_a_scan_of_every_word_bans() -> None:
    """The index (words by their next-to-last token) against the plain reading: every word
    whose lead the output ends with, on seeded random words and outputs."""
    import random

    from engine_service.model.bad_words import banned_next, word_index

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for _ in range(300):
        words = [tuple(rng.randrange(6) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 6))]
        output = [rng.randrange(6) for _ in range(rng.randint(0, 8))]
        expected = [w[-1] for w in words
                    if len(w) - 1 <= len(output)
                    and tuple(output[len(output) - len(w) + 1:]) == w[:-1]]
        assert sorted(banned_next(word_index(words), output)) == sorted(expected), (
            words, output)


def test_bad_words_ban_one_token_words_always_and_longer_ones_at_their_last_token() -> None:
    logits = torch.zeros(3, 20)
    logits[:, 7] = 5.0  # every row's favourite
    logits[:, 8] = 4.0
    words = ((7,), (3, 4, 8))

    def params() -> SamplingParams:
        return SamplingParams(temperature=0, bad_words_token_ids=words)

    rows = [row(params()),  # 7 banned: 8 next
            row(params(), output=[1, 3]),  # "3 4" not yet written: 8 stays
            row(params(), output=[3, 4])]  # 8 would complete "3 4 8"
    logits[2, 7] = -1.0
    assert Sampler(20, {EOS})(logits, rows).token_ids == [8, 8, 0]


def test_bad_words_tokenize_as_the_model_writes_them(tiny_llama_dir) -> None:
    from transformers import AutoTokenizer

    from engine_service.model.bad_words import bad_words_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = bad_words_token_ids(tokenizer, ["Paris is", "  hello", "hello"])
    texts = [tokenizer.decode(list(word)) for word in ids]
    assert texts == ["Paris is", " Paris is", "hello", " hello"]  # alone, after a space
