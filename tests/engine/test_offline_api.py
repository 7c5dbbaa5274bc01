"""The offline API as a vLLM user drives it: bad arguments get a ValueError naming the argument
and the value, a closed LLM says so, and Ctrl-C while generating leaves an LLM that still works
(under tensor parallelism too)."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from engine_service import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, live_llms):
    llm = LLM(model=str(tiny_llama_dir), block_size=16, num_blocks=64, max_model_len=128)
    live_llms.append(llm)
    yield llm
    live_llms.remove(llm)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("n", 0, "n must be between 1 and 64, got 0"),
    ("max_tokens", -5, "max_tokens must be >= 1 or None, got -5"),
    ("temperature", "0", "temperature must be a number"),
])
def test_sampling_params_assigned_after_construction_are_checked(llm, field, value, match):
    # Before: n = 0 ran a completion of 16 tokens, max_tokens = -5 one of 1 token.
    params = SamplingParams(max_tokens=2)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=match):
        llm.generate("Hello", params)


def test_stop_assigned_as_a_string_is_one_stop_string(llm):
    # Before: "ab" was iterated as the stop strings "a" and "b".
    params = SamplingParams(max_tokens=2)
    params.stop = "ab"
    llm.generate("Hello", params)
    assert params.stop == ["ab"]


@pytest.mark.parametrize(("sampling_params", "match"), [
    ({"max_tokens": 2}, "sampling_params must be a SamplingParams.*got \"{'max_tokens': 2}\""),
    ([SamplingParams(), {"max_tokens": 2}], "sampling_params must be a SamplingParams"),
    ("greedy", "sampling_params must be a SamplingParams.*got 'greedy'"),
])
def test_sampling_params_of_the_wrong_type(llm, sampling_params, match):
    # Before: AttributeError: 'str' object has no attribute 'check_for_model'.
    with pytest.raises(ValueError, match=match):
        llm.generate(["a", "b"], sampling_params)


@pytest.mark.parametrize(("priority", "match"), [
    (["x"], r"priority must be a list of ints .* got \"\['x'\]\""),
    (5, "priority must be a list of ints .* got '5'"),
    ([1, 2], r"priority must have one entry per prompt \(1\), got 2"),
])
def test_bad_priority(llm, priority, match):
    # Before: ["x"] was accepted and 5 raised TypeError: object of type 'int' has no len().
    with pytest.raises(ValueError, match=match):
        llm.generate(["a"], SamplingParams(max_tokens=1), priority=priority)


@pytest.mark.parametrize(("prompt", "match"), [
    ({"prompt": 5}, r"prompt\['prompt'\] must be a string, got int: '5'"),
    ({"promt": "a"}, "a prompt dict takes the keys prompt, prompt_token_ids, cache_salt, "
                     "got 'promt'"),
    ({"prompt": "a", "cache_salts": "x"}, "got 'cache_salts'"),
    ({"prompt_token_ids": "abc"}, "prompt_token_ids must be a list of ints, got str: 'abc'"),
    ({"prompt": "a", "cache_salt": 7}, "cache_salt must be a string or None, got 7"),
])
def test_bad_prompt_dict(llm, prompt, match):
    # Before: a misspelt key was ignored (a misspelt cache_salt shared the cache), a non-string
    # prompt failed inside the tokenizer without naming the argument.
    with pytest.raises(ValueError, match=match) as caught:
        llm.generate(prompt, SamplingParams(max_tokens=1))
    assert caught.value.field in ("prompt", "prompt_token_ids", "cache_salt")


@pytest.mark.parametrize(("messages", "match"), [
    ("hi", "messages must be a list of .* got str: 'hi'"),
    ([{"role": "user"}], "messages must be a list of .* got \"\\[{'role': 'user'}\\]\""),
    ([["hi"]], "messages must be a list of"),
])
def test_bad_chat_messages(llm, messages, match):
    # Before: TypeError from transformers, or jinja's UndefinedError naming no argument.
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, SamplingParams(max_tokens=1))


def test_unknown_engine_argument_lists_the_known_ones(tiny_llama_dir):
    # Before: "EngineConfig.__init__() got an unexpected keyword argument 'tokenizer'".
    with pytest.raises(TypeError, match=r"LLM\(\) got unknown keyword argument\(s\) tokenizer; "
                                        r"the engine settings are: block_size, num_blocks"):
        LLM(model=str(tiny_llama_dir), tokenizer=str(tiny_llama_dir))


def test_context_manager_closes_and_a_closed_llm_says_so(tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), num_blocks=16) as llm:
        [out] = llm.generate("Hello", SamplingParams(max_tokens=2))
        assert len(out.outputs[0].token_ids) == 2
    for call in (lambda: llm.generate("Hello"), lambda: llm.chat([{"role": "user",
                                                                   "content": "hi"}])):
        with pytest.raises(RuntimeError, match="this LLM is closed"):
            call()
    llm.close()  # idempotent


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler while a test presses Ctrl-C: a suite started in the
    background by a non-interactive shell (`cmd &`) inherits SIGINT ignored, and Python then
    leaves it ignored, so the interrupt never came and three tests failed there."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupted_then_generates(llm: LLM) -> float:
    """Ctrl-C 2 ms into a long generate's third step (timed from the step, not the clock, so
    it lands in a step on any machine: inside one, under tensor parallelism, is what hung);
    returns how long the next generate took."""
    engine = llm.llm_engine
    step = engine.step
    steps = []

    def step_then_interrupted():
        steps.append(1)
        if len(steps) == 3:
            threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGINT)).start()
        return step()

    engine.step = step_then_interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Hello"] * 8, SamplingParams(n=4, max_tokens=1000, ignore_eos=True))
    finally:
        del engine.step  # (the instance attribute: the class's method again)
    assert len(steps) >= 3
    assert not engine.has_unfinished_requests()
    assert engine.check_block_invariants() == []
    start = time.monotonic()
    [out] = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))
    assert len(out.outputs[0].token_ids) == 4
    return time.monotonic() - start


def test_ctrl_c_while_generating(tiny_llama_dir, make_llm, python_sigint):
    llm = make_llm(tiny_llama_dir, num_blocks=1024, max_model_len=2048)
    _interrupted_then_generates(llm)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_while_generating_tensor_parallel(tiny_llama_dir, make_llm, python_sigint):
    # Before: the interrupt cut rank 0 out of a step's collective; the next generate waited
    # for gloo's 60 s timeout and failed with "rank 1 ... Timed out waiting".
    llm = make_llm(tiny_llama_dir, num_blocks=1024, max_model_len=2048, tensor_parallel_size=2)
    try:
        assert _interrupted_then_generates(llm) < 10
    finally:
        llm.close()


def test_generate_leaves_no_thread_behind(tiny_llama_dir):
    # Before: a disabled tqdm bar still started tqdm's monitor thread, alive after generate.
    code = (
        "import threading\n"
        "from engine_service import LLM, SamplingParams\n"
        f"llm = LLM(model={str(tiny_llama_dir)!r}, num_blocks=16)\n"
        "llm.generate('Hello', SamplingParams(max_tokens=2))\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['MainThread']"


def test_inputs_a_vllm_user_passes_are_taken(llm):
    """What the type checks must not refuse (they did): token ids as a range, numpy integer
    priorities, messages as a tuple, an assistant's tool call without content."""
    import numpy as np

    [by_range] = llm.generate({"prompt_token_ids": range(5, 9)}, SamplingParams(max_tokens=2))
    assert by_range.prompt_token_ids == [5, 6, 7, 8]
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=1),
                        priority=[np.int64(1), np.int64(0)])
    assert len(outs) == 2
    [chat] = llm.chat(({"role": "user", "content": "hi"},), SamplingParams(max_tokens=1))
    assert len(chat.outputs[0].token_ids) == 1


@pytest.mark.parametrize("queued", [False, True], ids=["before-queued", "after-queued"])
def test_an_interrupt_while_adding_the_batch_leaves_no_request_behind(tiny_llama_dir, make_llm,
                                                                      monkeypatch, queued):
    """Ctrl-C (or any failure) inside add_request of the second prompt, before or after the
    engine queued it. The requests added stayed queued (and with `queued`, the one being
    added): the next generate stepped them too and failed on their ids (KeyError)."""
    llm = make_llm(tiny_llama_dir, num_blocks=16)
    add = llm.llm_engine.add_request
    calls = []

    def add_interrupted(*args, **kwargs):
        calls.append(args[0])
        if queued:
            add(*args, **kwargs)
        if len(calls) == 2:
            raise KeyboardInterrupt
        if not queued:
            add(*args, **kwargs)

    monkeypatch.setattr(llm.llm_engine, "add_request", add_interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2))
    monkeypatch.setattr(llm.llm_engine, "add_request", add)
    assert not llm.llm_engine.has_unfinished_requests()
    [out] = llm.generate("Hello", SamplingParams(max_tokens=2))
    assert len(out.outputs[0].token_ids) == 2


def test_ctrl_c_as_the_last_step_ends_is_not_lost(tiny_llama_dir, make_llm, monkeypatch,
                                                  python_sigint):
    # It came in after the last between-steps check: the deferred interrupt was dropped and
    # generate returned as if nobody had pressed it.
    llm = make_llm(tiny_llama_dir, num_blocks=16)
    engine = llm.llm_engine
    unfinished = engine.has_unfinished_requests

    def unfinished_then_interrupted():
        left = unfinished()
        if not left:
            os.kill(os.getpid(), signal.SIGINT)
        return left

    monkeypatch.setattr(engine, "has_unfinished_requests", unfinished_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate("Hello", SamplingParams(max_tokens=2))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_chat_continues_the_final_message_as_vllm_s_llm_chat(llm, tiny_llama_dir):
    """add_generation_prompt and continue_final_message as transformers renders them; both
    true is a ValueError naming continue_final_message."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_llama_dir)
    begun = [{"role": "user", "content": "Name three colours."},
             {"role": "assistant", "content": "Red, green and"}]
    for flags, hf_flags in (
            ({"continue_final_message": True},
             {"add_generation_prompt": False, "continue_final_message": True}),
            ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
            ({}, {"add_generation_prompt": True})):
        [out] = llm.chat(begun, SamplingParams(max_tokens=1), **flags)
        text = hf.apply_chat_template(begun, tokenize=False, **hf_flags)
        assert out.prompt_token_ids == hf.encode(text, add_special_tokens=False), flags
    with pytest.raises(ValueError, match="continue_final_message must be false when "
                                         "add_generation_prompt is true"):
        llm.chat(begun, add_generation_prompt=True, continue_final_message=True)


def test_truncate_prompt_tokens_runs_the_prompt_s_last_tokens(llm):
    """vLLM's: the output of a prompt cut to its last k tokens is the output of those k
    tokens; -1 cuts to the longest prompt the context takes (a prompt past it runs)."""
    prompt = list(range(300, 420))  # 120 tokens of a 128-token context
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    [cut] = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(truncate_prompt_tokens=10, **greedy))
    [short] = llm.generate({"prompt_token_ids": prompt[-10:]}, SamplingParams(**greedy))
    assert cut.prompt_token_ids == prompt[-10:]
    assert cut.outputs[0].token_ids == short.outputs[0].token_ids
    long_prompt = list(range(300, 500))  # 200 tokens: past the context
    with pytest.raises(ValueError, match="prompt must be at most 127 tokens"):
        llm.generate({"prompt_token_ids": long_prompt}, SamplingParams(max_tokens=1))
    [fitted] = llm.generate({"prompt_token_ids": long_prompt},
                            SamplingParams(truncate_prompt_tokens=-1, max_tokens=1))
    assert fitted.prompt_token_ids == long_prompt[-127:]
