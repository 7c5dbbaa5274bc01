"""A tensor-parallel worker that dies or hangs at any phase fails the offline engine with
TensorParallelError, never a hang, and leaves no process (issue 33): before its rendezvous,
while loading its shards, between two steps (a hang where rank 0's next step broadcast has
no receiver), and the next engine starts as usual (no stale lock). Real processes, gloo, two
ranks of one torch thread each; the served engine's phases are in
tests/service/test_tensor_parallel_phases.py."""

import os
import signal
import threading

import pytest

from engine_service import LLM, SamplingParams
from engine_service.model.parallel.errors import TensorParallelError
from engine_service.model.parallel.worker import STOP_AT_ENV
from tests.service.test_engine_death import child_pids, wait_gone
from tests.support.gloo_pair import two_channels
from tests.support.process_state import process_state, wait_until

WORKER_MODULE = b"engine_service.model.parallel.worker"

DEADLINE_S = 120.0  # generous: engine start-ups on a loaded 2-core machine


def test_a_step_broadcast_nobody_receives_times_out():
    """Rank 0's send of a step waits for each worker to post its receive: a worker stopped
    between two steps would hold it for ever. It gives up after the collective timeout; the
    workers still wait for the next step as long as the engine idles."""
    stores, (rank0, rank1) = two_channels((b"k" * 32, b"k" * 32), timeout_s=2)
    failed: list[BaseException] = []

    def send() -> None:
        try:
            rank0.send({"step": 1})
        except RuntimeError as error:
            failed.append(error)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "the step broadcast waited for ever on a worker that hangs"
    assert failed and "Timed out" in str(failed[0])


def _wait_for(condition, what: str) -> None:
    wait_until(condition, what, DEADLINE_S)


@pytest.mark.parametrize("phase", ["rendezvous", "load"])
def test_a_worker_killed_while_starting_fails_the_start_at_once(phase, tiny_llama_dir,
                                                                monkeypatch):
    """The worker stops itself on reaching the phase; once it is stopped it is killed. Rank 0
    (this process) waits there for it (for the store's or the collective timeout, before: an
    hour here): it must fail at once with the rank's exit, leave no process, and the next
    engine start."""
    monkeypatch.setenv(STOP_AT_ENV, phase)
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", num_blocks=32,
                tensor_parallel_timeout_s=3600)
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 (the test looks at it)
            outcome.append(error)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    workers: list[int] = []
    _wait_for(lambda: workers.extend(child_pids(os.getpid(), WORKER_MODULE)) or workers,
              "started a worker")
    worker = workers[0]
    _wait_for(lambda: process_state(worker) == "T", f"stopped at {phase}")
    os.kill(worker, signal.SIGKILL)
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"rank 0 still waits on a worker killed at {phase}"
    assert isinstance(outcome[0], TensorParallelError), outcome
    assert f"rank 1 (pid {worker}) exited with status -9" in str(outcome[0])
    assert wait_gone(worker)
    assert child_pids(os.getpid(), WORKER_MODULE) == []
    monkeypatch.delenv(STOP_AT_ENV)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", num_blocks=32)
    try:
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.close()


def test_the_test_stop_hook_is_inert_outside_a_test(tiny_llama_dir, monkeypatch):
    """PAGEDGEN_TP_TEST_STOP_AT stops a worker only under pytest (PYTEST_CURRENT_TEST, which
    pytest sets and the workers inherit): left in a user's environment it stalled every
    tensor-parallel start for the startup timeout (5 min), then failed it naming no cause."""
    monkeypatch.setenv(STOP_AT_ENV, "load")
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    outcome: list = []

    def start() -> None:
        try:
            outcome.append(LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32",
                               num_blocks=32))
        except BaseException as error:  # noqa: BLE001 (the test looks at it)
            outcome.append(error)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():  # (failing below: not left stopped for the startup timeout)
        for pid in child_pids(os.getpid(), WORKER_MODULE):
            os.kill(pid, signal.SIGKILL)
        thread.join(DEADLINE_S)
        pytest.fail("a worker stopped itself outside a test")
    llm = outcome[0]
    assert isinstance(llm, LLM), outcome
    try:
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.close()
    assert child_pids(os.getpid(), WORKER_MODULE) == []
