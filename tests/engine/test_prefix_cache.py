"""Prefix caching: shared prefixes are served from the cache, salts isolate tenants."""

from engine_service import SamplingParams
from tests.engine.prompts import PARAGRAPH

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _shared_prefix_prompts(tokenizer) -> tuple[list[int], list[int]]:
    prefix = tokenizer.encode(PARAGRAPH * 5)[:200]
    assert len(prefix) == 200
    first = prefix + tokenizer.encode(" Question one: what came first?")
    second = prefix + tokenizer.encode(" Question two: what came last?")
    return first, second


def _prefill_tokens(llm) -> int:
    """Tokens the engine has run through the model so far."""
    return llm.llm_engine.num_computed_tokens


def test_shared_prefix_is_cached_and_output_unchanged(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=128)
    first, second = _shared_prefix_prompts(llm.get_tokenizer())
    out_first = llm.generate({"prompt_token_ids": first}, PARAMS)[0]
    assert out_first.num_cached_tokens == 0
    before = _prefill_tokens(llm)
    out_second = llm.generate({"prompt_token_ids": second}, PARAMS)[0]
    computed = _prefill_tokens(llm) - before
    assert out_second.num_cached_tokens >= 192
    # Only the uncached part of the prompt is prefilled, then one token per decode step.
    assert computed == len(second) - out_second.num_cached_tokens + PARAMS.max_tokens - 1

    uncached = make_llm(tiny_llama_dir, block_size=16, num_blocks=128, enable_prefix_caching=False)
    reference = uncached.generate({"prompt_token_ids": second}, PARAMS)[0]
    assert reference.num_cached_tokens == 0
    assert out_second.outputs[0].token_ids == reference.outputs[0].token_ids


def test_different_cache_salt_shares_nothing(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=128)
    first, second = _shared_prefix_prompts(llm.get_tokenizer())
    llm.generate({"prompt_token_ids": first, "cache_salt": "tenant-a"}, PARAMS)
    other = llm.generate({"prompt_token_ids": second, "cache_salt": "tenant-b"}, PARAMS)[0]
    assert other.num_cached_tokens == 0
    same = llm.generate({"prompt_token_ids": second, "cache_salt": "tenant-a"}, PARAMS)[0]
    assert same.num_cached_tokens >= 192


def test_identical_prompt_recomputes_only_last_token(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=128)
    prompt = list(range(100, 164))  # exactly 4 full blocks
    llm.generate({"prompt_token_ids": prompt}, PARAMS)
    again = llm.generate({"prompt_token_ids": prompt}, PARAMS)[0]
    # The block holding the last prompt token is recomputed so there are logits to sample.
    assert again.num_cached_tokens == 48


def test_hash_collision_never_shares_other_tokens(make_llm, tiny_llama_dir):
    """A cached block whose stored tokens differ from the request's is not shared, even when
    the hash matches (forced here by overwriting the stored tokens)."""
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=128)
    prompt = list(range(200, 248))
    llm.generate({"prompt_token_ids": prompt}, PARAMS)
    pool = llm.llm_engine.pool
    for block in pool.blocks:
        if block.token_ids is not None:
            block.token_ids = tuple(t + 1 for t in block.token_ids)
    again = llm.generate({"prompt_token_ids": prompt}, PARAMS)[0]
    assert again.num_cached_tokens == 0


def _burst_prompts(tokenizer) -> list[list[int]]:
    """Four prompts on one 200-token prefix (12 full blocks of 16), each its own question."""
    prefix = tokenizer.encode(PARAGRAPH * 5)[:200]
    return [prefix + tokenizer.encode(f" Question {word}: what came next?")
            for word in ("one", "two", "three", "four")]


def test_a_burst_for_one_new_prefix_computes_it_once(make_llm, tiny_llama_dir):
    """Requests that arrive together for a prefix nobody holds: the first computes it, the
    others wait one step and find it cached (without this, all four prefilled it in one
    step). Tokens as without the cache."""
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=128)
    prompts = _burst_prompts(llm.get_tokenizer())
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert [o.num_cached_tokens for o in outs] == [0, 192, 192, 192]
    computed = _prefill_tokens(llm)
    assert computed == sum(len(p) for p in prompts) - 3 * 192 + 4 * (PARAMS.max_tokens - 1)
    assert llm.llm_engine.scheduler.counters.num_prefill_deferrals == 3

    uncached = make_llm(tiny_llama_dir, block_size=16, num_blocks=128, enable_prefix_caching=False)
    reference = uncached.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    assert uncached.llm_engine.scheduler.counters.num_prefill_deferrals == 0

    undeferred = make_llm(tiny_llama_dir, block_size=16, num_blocks=128,
                          defer_shared_prefill=False)
    again = undeferred.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert [o.num_cached_tokens for o in again] == [0, 0, 0, 0]  # all in one step
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_a_burst_under_other_salts_is_not_deferred(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=128)
    prompt = _burst_prompts(llm.get_tokenizer())[0]
    outs = llm.generate([{"prompt_token_ids": prompt, "cache_salt": f"tenant-{i}"}
                         for i in range(3)], PARAMS)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert llm.llm_engine.scheduler.counters.num_prefill_deferrals == 0


def _first_token_steps(engine, requests) -> tuple[dict[str, int], dict[str, object]]:
    """Adds (request_id, prompt, params) in order, runs them all: the step each one's first
    token came at, and each one's final output."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    first, final, step = {}, {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, step)
            if out.finished:
                final[out.request_id] = out
        step += 1
    return first, final


def test_a_deferred_request_does_not_hold_up_the_ones_behind_it(make_llm, tiny_llama_dir):
    """Waiting: A (new prefix), B (A's prefix), C (another). The first step runs A and C; B
    waits one step, then runs with A's prefix cached."""
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=128)
    first, second, _, _ = _burst_prompts(llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    steps, final = _first_token_steps(llm.llm_engine, [
        ("a", first, params), ("b", second, params), ("c", list(range(300, 340)), params)])
    assert steps == {"a": 0, "c": 0, "b": 1}
    assert final["b"].num_cached_tokens == 192


def test_a_deferred_request_keeps_its_place_for_memory(make_llm, tiny_llama_dir):
    """A pool of 14 blocks: A (a 4-block prefix and a turn) runs; B (A's prefix, a longer turn)
    waits one step for it; C (unrelated, long) arrived after B. B's blocks stay held for it,
    so C is not admitted into them, and B runs next step instead of after C ends."""
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=14)
    prefix = list(range(500, 564))
    requests = [
        ("a", prefix + list(range(600, 608)), SamplingParams(temperature=0, max_tokens=40,
                                                               ignore_eos=True)),
        ("b", prefix + list(range(700, 740)), SamplingParams(temperature=0, max_tokens=4,
                                                               ignore_eos=True)),
        ("c", list(range(800, 900)), SamplingParams(temperature=0, max_tokens=40,
                                                    ignore_eos=True)),
    ]
    steps, final = _first_token_steps(llm.llm_engine, requests)
    assert steps["b"] == 1 and steps["c"] > steps["b"], steps
    assert final["b"].num_cached_tokens == 64
    assert llm.llm_engine.scheduler.counters.num_prefill_deferrals == 1


def test_the_engine_flag_turns_deferral_off(tiny_llama_dir, test_certs):
    from engine_service.serving.server import engine_config_from_args, parse_args
    from trust.cli_args import tls_argv

    tls = tls_argv(test_certs.files("engine"))
    on = engine_config_from_args(parse_args(tls), str(tiny_llama_dir))
    off = engine_config_from_args(parse_args(["--no-defer-shared-prefill", *tls]),
                                  str(tiny_llama_dir))
    assert on.defer_shared_prefill and not off.defer_shared_prefill


def test_a_step_passes_over_at_most_its_bound_of_waiting_requests(make_llm, tiny_llama_dir):
    """40 requests on one new prefix: the first step runs one, passes over 32 and looks at no
    more (each look is a prefix lookup); the next finds the prefix cached for all of them."""
    from engine_service.core.scheduler import MAX_DEFERRED_PER_STEP

    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=256)
    engine = llm.llm_engine
    prefix = list(range(900, 932))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(40):
        engine.add_request(f"r{i}", prefix + [1000 + i], params)
    engine.step()
    assert engine.scheduler.counters.num_prefill_deferrals == MAX_DEFERRED_PER_STEP == 32
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(o.num_cached_tokens for o in finished.values()) == [0] + [32] * 39


def test_a_deferred_request_holds_only_the_blocks_it_will_not_share(make_llm, tiny_llama_dir):
    """A pool of 16: A (a 4-block prefix and a turn, 5 blocks) runs; B (A's prefix, 7 blocks)
    waits a step and will share A's 4, so it holds 3; C (6 blocks) fits beside them at once."""
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=16)
    prefix = list(range(500, 564))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    steps, final = _first_token_steps(llm.llm_engine, [
        ("a", prefix + list(range(600, 608)), params),
        ("b", prefix + list(range(700, 740)), params),
        ("c", list(range(800, 896)), params)])
    assert steps == {"a": 0, "c": 0, "b": 1}
    assert final["b"].num_cached_tokens == 64
