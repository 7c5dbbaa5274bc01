"""Host work per step in O(batch), not O(tokens so far) (issue 36): outputs carry deltas only,
penalty counts are kept per sequence (and equal counts recomputed from scratch), the decode
graphs' block tables are written incrementally, the detokenizer's fast decode gives decode()'s
text, and a step late in a request executes what one early executes (exact counts of calls
and bytecode instructions). Structure is checked here; the times are bench/step_loop.py's."""

import random

import pytest
import torch

from bench.step_work import count_step_work, differences
from engine_service import SamplingParams
from engine_service.core.sequence import Sequence, SequenceGroup, TokenView
from engine_service.model.beam_search_params import BeamSearchParams
from engine_service.model.detokenizer import IncrementalDetokenizer, backend_decode
from engine_service.model.sampler import Sampler, SamplingRow
from tests.engine.sampling_fixtures import build_sentencepiece_style_tokenizer

LONG = 2000


def _copy_counter(monkeypatch) -> dict[str, int]:
    """Counts the whole-list copies a sequence makes (its copying properties) and the reads
    of a detokenizer's whole text."""
    calls = {"output": 0, "prompt": 0, "text": 0}
    output_prop, prompt_prop = Sequence.output_token_ids, Sequence.prompt_token_ids
    text_prop = IncrementalDetokenizer.text

    def text(detokenizer):
        calls["text"] += 1
        return text_prop.fget(detokenizer)

    def output(seq):
        calls["output"] += 1
        return output_prop.fget(seq)

    def prompt(seq):
        calls["prompt"] += 1
        return prompt_prop.fget(seq)

    monkeypatch.setattr(Sequence, "output_token_ids", property(output))
    monkeypatch.setattr(Sequence, "prompt_token_ids", property(prompt))
    monkeypatch.setattr(IncrementalDetokenizer, "text", property(text))
    return calls


def test_outputs_carry_deltas_only_over_2000_tokens(make_llm, tiny_llama_dir, monkeypatch):
    """Every step's output holds at most the step's token (and its text and logprob) per
    sequence, never the whole output; the sequences' token lists are copied once per
    request (the final output), not once per step; the deltas add up to the final output."""
    engine = make_llm(tiny_llama_dir, num_blocks=512, max_model_len=LONG + 64).llm_engine
    calls = _copy_counter(monkeypatch)
    engine.add_request("greedy", [31, 32, 33], SamplingParams(
        temperature=0, max_tokens=LONG, ignore_eos=True, logprobs=1))
    engine.add_request("two", list(range(100, 140)), SamplingParams(
        temperature=1.0, n=2, seed=7, max_tokens=LONG, ignore_eos=True, repetition_penalty=1.2))
    streamed: dict[tuple[str, int], dict] = {}
    prompts: dict[str, list[int]] = {}
    finals = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_steps += 1
        for out in outputs:
            # One prompt list for all of a request's outputs, not a copy per step.
            assert prompts.setdefault(out.request_id, out.prompt_token_ids) is out.prompt_token_ids
            for c in out.outputs:
                seen = streamed.setdefault((out.request_id, c.index),
                                           {"ids": [], "text": "", "lps": []})
                assert len(c.token_ids_delta) <= 1, (num_steps, c.token_ids_delta)
                # One token's text (SmolLM2's longest is 81 characters), or a few while a
                # character split over tokens is held back.
                assert len(c.text_delta) <= 200, (num_steps, c.text_delta)
                seen["ids"] += c.token_ids_delta
                seen["text"] += c.text_delta
                seen["lps"] += c.logprobs_delta or []
                assert c.num_tokens == len(seen["ids"])
                if not out.finished:
                    assert c.token_ids is None and c.text is None and c.logprobs is None
            if out.finished:
                finals[out.request_id] = out
    assert num_steps >= LONG
    # Once per sequence (its final output) and per request (its prompt): not per step.
    assert calls == {"output": 3, "prompt": 2, "text": 3}
    for (request_id, index), seen in streamed.items():
        final = finals[request_id].outputs[index]
        assert len(final.token_ids) == LONG and final.num_tokens == LONG
        assert seen["ids"] == final.token_ids and seen["text"] == final.text
        if request_id == "greedy":
            assert seen["lps"] == final.logprobs and len(final.logprobs) == LONG
            assert [lp.token_id for lp in final.logprobs] == final.token_ids
    assert engine.sampler.token_counts.num_held == 0


def _step_windows(engine, window: int) -> tuple:
    """What `window` steps execute after ~80 output tokens and after ~560: the two windows
    start a whole number of 16-token blocks apart, so each crosses the same block boundaries
    (a block filled, hashed, allocated)."""
    for _ in range(48):
        engine.step()
    early = count_step_work(engine, window)
    for _ in range(30 * 16 - window):  # 30 blocks on
        engine.step()
    late = count_step_work(engine, window)
    assert all(len(s.token_ids) > 500 for g in engine.scheduler.running for s in g.seqs)
    return early, late


@pytest.fixture
def no_timed_refresh(monkeypatch):
    """The pin budget is also refreshed once a second: a wall-clock path, not the output's."""
    monkeypatch.setattr("engine_service.core.engine.PIN_BUDGET_REFRESH_S", float("inf"))


def test_step_work_without_text_is_the_same_early_and_late(make_llm, tiny_llama_dir,
                                                           no_timed_refresh):
    """A step after ~560 output tokens executes exactly what a step after ~80 executes: every
    function called as often, every Python function running as many bytecode instructions.
    A walk over the output so far in Python, per token or per block, every step or every
    block, adds instructions; a call made per token or block adds calls. (One C call whose
    own work grows is not seen here: bench/step_work.py says which tests count those.) Token
    ids only (detokenize off, as in the serving core), so no path depends on which token
    came: greedy with logprobs, n = 2 seeded sampling with every penalty, top-k, top-p and
    min_tokens, prefix caching on."""
    engine = make_llm(tiny_llama_dir, num_blocks=512, max_model_len=1024,
                      detokenize=False).llm_engine
    engine.add_request("greedy", [31, 32, 33], SamplingParams(
        temperature=0, max_tokens=900, ignore_eos=True, logprobs=2))
    engine.add_request("two", list(range(100, 140)), SamplingParams(
        temperature=1.0, n=2, seed=7, max_tokens=900, ignore_eos=True, repetition_penalty=1.2,
        frequency_penalty=0.1, presence_penalty=0.2, top_k=50, top_p=0.9, min_tokens=600))
    engine.add_request("nucleus", list(range(300, 310)), SamplingParams(
        temperature=0.7, seed=3, max_tokens=900, ignore_eos=True, top_p=0.8, logprobs=1))
    early, late = _step_windows(engine, 32)
    assert sum(len(g.seqs) for g in engine.scheduler.running) == 4
    assert not differences(early.calls, late.calls), "calls over 32 steps, early -> late"
    assert not differences(early.instructions, late.instructions), (
        "bytecode instructions over 32 steps, early -> late")


def test_step_work_with_text_grows_only_by_the_tokens_path(make_llm, tiny_llama_dir,
                                                           no_timed_refresh):
    """With text (the offline API's incremental detokenizer and a stop string's hold-back),
    which token came picks the detokenizer's path (a token's text kept for the next decode, a
    character split over tokens held back): those functions, and the C functions they call,
    may differ by a few per token either way; every other function executes exactly what it
    executed early."""
    engine = make_llm(tiny_llama_dir, num_blocks=512, max_model_len=1024).llm_engine
    engine.add_request("greedy", [31, 32, 33], SamplingParams(
        temperature=0, max_tokens=900, ignore_eos=True, logprobs=2))
    engine.add_request("two", list(range(100, 140)), SamplingParams(
        temperature=1.0, n=2, seed=7, max_tokens=900, ignore_eos=True, repetition_penalty=1.2))
    engine.add_request("stop", list(range(300, 310)), SamplingParams(
        temperature=0.7, seed=3, max_tokens=900, ignore_eos=True, stop=["zq!x"]))
    window, sequences = 32, 4
    early, late = _step_windows(engine, window)

    def token_path(fn: str) -> bool:
        # The detokenizer's own functions, the engine's hand-over of a token's text (kept
        # only when not empty), and C functions (called from those paths too).
        return ("model/detokenizer.py:" in fn or fn.endswith(":LLMEngine._sample_rows")
                or fn.startswith("~:"))

    for kind, per_token in (("calls", 1), ("instructions", 16)):
        moved = differences(getattr(early, kind), getattr(late, kind))
        assert not {fn: c for fn, c in moved.items() if not token_path(fn)}, kind
        # A few per token: one call, or 16 instructions, per sequence per step.
        allowed = per_token * sequences * window
        assert not {fn: c for fn, c in moved.items() if abs(c[1] - c[0]) > allowed}, kind


def test_generate_returns_whole_completions(make_llm, tiny_llama_dir):
    """The offline API's results carry the whole text, tokens and logprobs, as streamed."""
    llm = make_llm(tiny_llama_dir, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    [out] = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
    completion = out.outputs[0]
    assert out.finished and out.prompt_token_ids == [5, 6, 7]
    assert len(completion.token_ids) == 20 == completion.num_tokens
    assert len(completion.logprobs) == 20
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids,
                                                         skip_special_tokens=True)


def test_final_output_only_makes_no_output_per_step(make_llm, tiny_llama_dir):
    """The offline API's requests get one output, the final one, whole; the same request
    streamed gives deltas that add up to it."""
    engine = make_llm(tiny_llama_dir, num_blocks=64).llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    engine.add_request("final", [7, 8, 9], params, final_output_only=True)
    engine.add_request("streamed", [7, 8, 9], params)
    outputs: dict[str, list] = {"final": [], "streamed": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    [final] = outputs["final"]
    assert len(outputs["streamed"]) == 30 and outputs["streamed"][-1].finished
    whole, streamed = final.outputs[0], outputs["streamed"][-1].outputs[0]
    assert final.finished and whole.token_ids == streamed.token_ids and len(whole.token_ids) == 30
    assert whole.text == streamed.text and whole.logprobs == streamed.logprobs
    # Its one output's deltas are the whole completion (nothing was streamed before).
    assert whole.token_ids_delta == whole.token_ids and whole.text_delta == whole.text
    assert whole.logprobs_delta == whole.logprobs


def _counts_from_scratch(token_ids: list[int], num_prompt: int, vocab: int):
    counts = torch.zeros(vocab)
    for token in token_ids[num_prompt:]:
        counts[token] += 1
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[token_ids] = True
    return counts, seen


def test_penalties_after_2000_tokens_equal_recomputed_ones() -> None:
    """Rows whose counts the sampler keeps (a slot, updated with each sampled token) choose
    exactly the tokens of rows whose counts are rebuilt from their token lists every step,
    for 2,000 steps; the kept counts then equal counts recomputed from the tokens."""
    vocab, eos = 40, 0
    gen = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=None),
        SamplingParams(temperature=0, frequency_penalty=0.05, presence_penalty=0.3,
                       max_tokens=None),
        SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=-0.02,
                       presence_penalty=0.5, min_tokens=30, stop_token_ids=[7],
                       max_tokens=None),
        SamplingParams(temperature=0.9, seed=3, repetition_penalty=1.1, frequency_penalty=0.01,
                       max_tokens=None),
        SamplingParams(temperature=0, max_tokens=None),  # no penalties: no slot
    ]
    kept, rebuilt = Sampler(vocab, {eos}), Sampler(vocab, {eos})
    tokens = [torch.randint(1, vocab, (i + 2,), generator=gen).tolist() for i in range(5)]
    num_prompt = [len(t) for t in tokens]
    penalized = [k for k, p in enumerate(params) if p.has_penalties]
    made = kept.token_counts.add([(TokenView(tokens[k], 0, num_prompt[k]),
                                   TokenView(tokens[k], num_prompt[k])) for k in penalized])
    slots = [made[penalized.index(k)] if k in penalized else None for k in range(len(params))]
    generators = [(torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))
                  if p.seed is not None else (None, None) for p in params]
    for step in range(LONG):
        # A coarse grid: penalties flip the argmax often; noise breaks ties.
        logits = torch.randint(-2, 3, (5, vocab), generator=gen).float()
        logits += torch.rand(5, vocab, generator=gen) * 1e-3
        kept_rows = [SamplingRow(p, TokenView(t, 0, n), TokenView(t, n), g[0], slot)
                     for p, t, n, g, slot in zip(params, tokens, num_prompt, generators, slots,
                                                 strict=True)]
        rebuilt_rows = [SamplingRow(p, t[:n], t[n:], g[1])
                        for p, t, n, g in zip(params, tokens, num_prompt, generators,
                                              strict=True)]
        chosen = kept(logits, kept_rows).token_ids
        assert chosen == rebuilt(logits, rebuilt_rows).token_ids, f"step {step}"
        for t, token in zip(tokens, chosen, strict=True):
            t.append(token)
    assert rebuilt.token_counts.num_held == 0  # its rows lived for one call each
    for t, n, slot in zip(tokens, num_prompt, slots, strict=True):
        if slot is None:
            continue
        counts, seen = _counts_from_scratch(t, n, vocab)
        assert torch.equal(kept.token_counts.counts[slot], counts)
        assert torch.equal(kept.token_counts.seen[slot], seen)
        assert counts.sum() == LONG


def test_engine_penalty_counts_after_2000_tokens(make_llm, tiny_llama_dir):
    """In the engine (n = 2: the forked sample gets its own row): after 2,000 tokens each
    sequence's counts equal counts recomputed from its tokens; the rows are released when
    the request ends."""
    engine = make_llm(tiny_llama_dir, num_blocks=512, max_model_len=LONG + 64).llm_engine
    params = SamplingParams(temperature=0.8, seed=11, n=2, repetition_penalty=1.3,
                            frequency_penalty=0.2, presence_penalty=0.1, max_tokens=LONG + 10,
                            ignore_eos=True)
    engine.add_request("p", list(range(200, 230)), params)
    group = engine.scheduler.waiting[0]
    while min((s.num_output_tokens for s in group.seqs), default=0) < LONG:
        engine.step()
    assert len(group.seqs) == 2
    vocab = engine.model_config.vocab_size
    store = engine.sampler.token_counts
    assert store.num_held == 2
    for seq in group.seqs:
        counts, seen = _counts_from_scratch(seq.token_ids, seq.num_prompt_tokens, vocab)
        assert torch.equal(store.counts[seq.penalty_slot].cpu(), counts)
        assert torch.equal(store.seen[seq.penalty_slot].cpu(), seen)
    engine.abort_request("p")
    assert store.num_held == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_decode_graph_tables_are_written_incrementally(make_llm, tiny_llama_dir, mode):
    """The graphs' buffers, run eagerly on the CPU: after each step the device table equals
    every scheduled sequence's block table and the host mirror; a step uploads only the
    entries that changed (new blocks), not the tables. Includes forks (n = 2, and beams, whose
    continuing beam copies its partial block on write in a row it keeps), arrivals and
    departures (rows moved), preemption (new tables)."""
    engine = make_llm(tiny_llama_dir, num_blocks=24, block_size=8, max_num_seqs=8,
                      preemption_mode=mode, swap_space=8 << 20).llm_engine
    engine.runner.capture_decode_graphs(8, engine.max_model_len)
    graphs = engine.runner.decode_graphs
    plain_run = graphs.run
    # (a sequence took a row, batch, new blocks, entries uploaded, entries in the tables)
    steps: list[tuple[bool, int, int, int, int]] = []

    def checked_run(scheduled):
        before = {item.seq.seq_id: graphs._row_of.get(item.seq.seq_id) for item in scheduled}
        written = {seq_id: graphs._written[row] for seq_id, row in before.items()
                   if row is not None}
        logits = plain_run(scheduled)
        device = graphs.dev32[graphs.region :].view(graphs.max_size, graphs.width)
        host = graphs.host32[graphs.region :].view(graphs.max_size, graphs.width)
        assert torch.equal(device, host)
        for item in scheduled:
            row = graphs._row_of[item.seq.seq_id]
            table = item.block_table
            assert device[row, : len(table)].tolist() == table
        took = any(graphs._row_of[seq_id] != row for seq_id, row in before.items())
        new_blocks = sum(len(item.block_table) - written.get(item.seq.seq_id, 0)
                         for item in scheduled)
        total = sum(len(item.block_table) for item in scheduled)
        steps.append((took, len(scheduled), new_blocks, graphs._num_staged, total))
        return logits

    graphs.run = checked_run
    _run_forking_workload(engine, random.Random(0), max_prompt=20)
    assert sum(took for took, *_ in steps) >= 5 and len(steps) > 40
    for took, batch, new_blocks, uploaded, _ in steps:
        if not took:  # new blocks, one copy-on-write per row at most, padding rows freed
            assert uploaded <= new_blocks + batch + graphs.max_size, steps
    assert 4 * sum(s[3] for s in steps) < sum(s[4] for s in steps), steps


def test_fast_decode_gives_decode_text() -> None:
    """The Rust decoder, where the detokenizer uses it, gives tokenizer.decode's text."""
    from tests.engine.sampling_fixtures import load_smollm2_tokenizer

    rng = random.Random(2)
    for tokenizer in (load_smollm2_tokenizer(), build_sentencepiece_style_tokenizer()):
        fast = backend_decode(tokenizer)
        assert fast == tokenizer.backend_tokenizer.decode
        size = len(tokenizer)
        for _ in range(300):
            ids = [rng.randrange(size) for _ in range(rng.randint(0, 8))]
            for skip in (True, False):
                assert fast(ids, skip_special_tokens=skip) == tokenizer.decode(
                    ids, skip_special_tokens=skip)
    cleaning = load_smollm2_tokenizer()
    cleaning.clean_up_tokenization_spaces = True  # transformers' own decode does more then
    assert backend_decode(cleaning) == cleaning.decode
    detok = IncrementalDetokenizer(cleaning, [], [])
    assert detok.add_token(cleaning.encode("hi")[0]) + detok.finish() == "hi"


def test_token_view_reads_in_place() -> None:
    tokens = [1, 2, 3]
    view = TokenView(tokens, 1)
    assert len(view) == 2 and list(view) == [2, 3] and view[-1] == 3 and view[:1] == [2]
    tokens.append(4)
    assert len(view) == 3 and 4 in view
    assert list(TokenView(tokens, 0, 2)) == [1, 2]
    with pytest.raises(IndexError):
        view[3]
    seq = Sequence(0, 0, [9, 8, 7], 2)
    group = SequenceGroup("r", [seq], SamplingParams(), None)
    assert group.prompt_token_ids is group.prompt_token_ids == [9, 8]
    assert list(seq.output_view) == [7] and list(seq.prompt_view) == [9, 8]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_eager_step_tables_are_kept_and_equal_the_tables(make_llm, tiny_llama_dir, mode):
    """The eager path's block tables (model/eager_block_tables.py): every step's gathered
    tables equal the scheduled sequences' block tables, zero padded, and a sequence keeps its
    row from step to step (rows are made again only on a new table: arrival, fork, swap-in,
    recompute), under chunked prefills, forks (n = 2 and beams, whose continuing beam copies its
    partial block on write), arrivals, departures and preemption."""
    engine = make_llm(tiny_llama_dir, num_blocks=24, block_size=8, max_num_seqs=8,
                      max_num_batched_tokens=32, preemption_mode=mode,
                      swap_space=8 << 20).llm_engine
    tables = engine.runner.eager_tables
    plain_gather = tables.gather
    rows_made = rows_kept = 0

    def checked_gather(scheduled):
        nonlocal rows_made, rows_kept
        before = dict(tables._rows)
        gathered = plain_gather(scheduled)
        longest = max(len(item.block_table) for item in scheduled)
        expected = [item.block_table + [0] * (longest - len(item.block_table))
                    for item in scheduled]
        assert gathered.tolist() == expected
        for item in scheduled:
            previous = before.get(item.seq.seq_id)
            kept = previous is tables._rows[item.seq.seq_id]
            if previous is not None and previous.table is item.block_table:
                assert kept, "a row made again for a table changed in place"
            rows_kept += kept
            rows_made += not kept
        return gathered

    tables.gather = checked_gather
    _run_forking_workload(engine, random.Random(1), max_prompt=40)
    assert rows_kept > 4 * rows_made > 0, (rows_kept, rows_made)


def _run_forking_workload(engine, rng: random.Random, max_prompt: int) -> None:
    """Arrivals over 20 steps (the first of each n = 2), a beam search from step 2 (a
    continuing beam writes its partial block after a fork), run to the end: into a small pool,
    so sequences are preempted."""
    plan = {0: 3, 5: 2, 9: 1, 20: 2}  # step -> requests added
    step = 0
    while plan or engine.has_unfinished_requests():
        for i in range(plan.pop(step, 0)):
            prompt = [rng.randrange(3, 5000) for _ in range(rng.randint(3, max_prompt))]
            engine.add_request(f"{step}-{i}", prompt, SamplingParams(
                temperature=1.0, seed=i, n=2 if i == 0 else 1, max_tokens=rng.randint(20, 60),
                ignore_eos=True))
        if step == 2:
            engine.add_request("beams", [rng.randrange(3, 5000) for _ in range(5)],
                               BeamSearchParams(beam_width=3, max_tokens=30).sampling_params())
        engine.step()
        step += 1
    assert engine.stats().num_preemptions > 0
