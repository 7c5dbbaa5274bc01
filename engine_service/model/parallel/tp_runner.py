"""Rank 0's model runner under tensor parallelism: the engine calls it as it calls a
ModelRunner (runner.py); each call that runs the model is broadcast to the workers first
(one message: the call and the block moves since the last one), then run on rank 0's own
shards, so every rank issues the same collectives in the same order.

Block moves (swap and copy-on-write lists) ride with the next call instead of a broadcast of
their own: a worker applies them before that call's forward, which is all the order the
scheduler needs (a swapped-out block is reused no earlier than the next forward).

With the graphs' buffers (cuda_graphs.py, mixed_graphs.py), a step the graphs take is sent as
the writes rank 0 prepared into its buffers (a DecodeStep or MixedStep: rows, tokens, the
block table's changed entries), not as step inputs: each worker applies them to its own
buffers and runs the same graph size, so every rank's buffers stay equal (their digests can be
compared: graph_buffer_digests). On the CPU the buffers run the forward eagerly; on CUDA no
graph is captured under tensor parallelism yet (kv_cache_setup.uses_cuda_graphs says why).
"""

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from engine_service.core.scheduler_output import BlockMoves, ScheduledSeq
from engine_service.model.parallel.channel import StepChannel
from engine_service.model.parallel.group import TensorParallelGroup
from engine_service.model.parallel.workers import TensorParallelError, Workers
from engine_service.model.runner import ModelRunner
from engine_service.model.step_inputs import StepInputs

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Call:
    # run_batch | run_decode_graph | run_mixed_graph | profile_run | allocate_kv_cache |
    # capture_decode_graphs | capture_mixed_graphs | graph_buffers_digest | stop
    method: str
    args: tuple = ()
    moves: list[BlockMoves] = field(default_factory=list)


@dataclass(slots=True)
class _WorkerState:
    own_num_blocks: int | None = None  # CUDA: what this rank's profile left room for


def _allocate_agreed(runner: ModelRunner, group: TensorParallelGroup, num_blocks: int,
                     num_cpu_blocks: int, own_num_blocks: int | None) -> None:
    """Every rank allocates the same number of blocks: the smallest any rank has room for
    (the block tables are shared, so a block id must exist on every rank)."""
    mine = num_blocks if own_num_blocks is None else min(num_blocks, own_num_blocks)
    runner.allocate_kv_cache(group.min_over_ranks(mine), num_cpu_blocks)


def graph_buffers_digest(runner: ModelRunner) -> bytes:
    """SHA-256 over the rank's graph buffers, host mirrors and device buffers (of nothing when
    it has none): equal on every rank after each step."""
    digest = hashlib.sha256()
    for graphs in (runner.decode_graphs, runner.mixed_graphs):
        if graphs is not None:
            for buffer in graphs.buffers():
                digest.update(buffer.cpu().numpy().tobytes())
    return digest.digest()


@torch.inference_mode()
def _run_graph_step(graphs, step) -> None:
    """Rank 0's writes into this worker's buffers, then the same graph (eager off CUDA)."""
    graphs.apply(step)
    graphs.launch(step)


def run_call(runner: ModelRunner, group: TensorParallelGroup, call: Call,
             state: _WorkerState) -> None:
    """A worker's side of one call."""
    for moves in call.moves:
        runner.apply_moves(moves)
    if call.method == "run_batch":
        runner.run_batch(*call.args)
    elif call.method == "run_decode_graph":
        _run_graph_step(runner.decode_graphs, *call.args)
    elif call.method == "run_mixed_graph":
        _run_graph_step(runner.mixed_graphs, *call.args)
    elif call.method == "profile_run":
        num_tokens, num_seqs, utilization = call.args
        if runner.device.type == "cuda":  # this rank's own plan, from its own free memory
            from engine_service.model.kv_cache_setup import profile_memory_plan
            from engine_service.model.runner import kv_bytes_per_block

            block_bytes = kv_bytes_per_block(runner.config, runner.block_size, runner.dtype)
            plan = profile_memory_plan(runner.device, utilization, block_bytes,
                                       lambda: runner.profile_run(num_tokens, num_seqs))
            state.own_num_blocks = plan.num_blocks
        else:
            runner.profile_run(num_tokens, num_seqs)
    elif call.method == "allocate_kv_cache":
        _allocate_agreed(runner, group, *call.args, state.own_num_blocks)
    elif call.method == "capture_decode_graphs":
        runner.capture_decode_graphs(*call.args)
    elif call.method == "capture_mixed_graphs":
        runner.capture_mixed_graphs(*call.args)
    elif call.method == "graph_buffers_digest":
        group.gather_digests(graph_buffers_digest(runner))
    else:
        raise ValueError(f"unknown tensor-parallel call {call.method!r}")


def serve_calls(runner: ModelRunner, group: TensorParallelGroup, key: bytes) -> None:
    """A worker's loop: rank 0's calls (authenticated under `key`) until 'stop'."""
    channel = StepChannel(group, key)
    state = _WorkerState()
    while True:
        call = channel.receive()
        if call.method == "stop":
            return
        run_call(runner, group, call, state)


class TensorParallelRunner:
    """Rank 0's runner. Attributes it does not define (device, dtype, kernels, config: this
    rank's model, block_size, kv_caches, ...) are its own shard runner's."""

    def __init__(self, local: ModelRunner, group: TensorParallelGroup, workers: Workers,
                 gpu_memory_utilization: float) -> None:
        self._local = local
        self.group = group
        self.workers = workers
        self.channel = StepChannel(group, workers.secret.encode())
        self._pending_moves: list[BlockMoves] = []
        self._utilization = gpu_memory_utilization
        self._failed = False

    def __getattr__(self, name: str):
        if name == "_local":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self._local, name)

    @property
    def tensor_parallel_size(self) -> int:
        return self.group.world_size

    @property
    def decode_graphs(self):
        return self._local.decode_graphs

    @property
    def mixed_graphs(self):
        return self._local.mixed_graphs

    def _run(self, method: str, args: tuple, local: Callable[[], object]) -> object:
        """Broadcast the call, then run it here; a failed collective names the rank that
        failed (TensorParallelError). Refused at once once the group has failed or closed: the
        workers are gone, or inside a collective rank 0 left, and a call would wait out the
        collective timeout before failing the same way."""
        if self._failed or self.workers.stopped:
            raise TensorParallelError(
                f"the tensor-parallel group is {'closed' if self.workers.stopped else 'broken'}"
                f" (an earlier call failed, or close() ran): {method} cannot run; start a new "
                f"engine")
        # Packed before anything goes out: a call that cannot be sent (it does not pickle, or
        # is too large) fails alone, the group as it was and the moves still pending.
        data = self.channel.pack(Call(method, args, self._pending_moves))
        self._pending_moves = []
        try:
            self.channel.send_packed(data)
            return local()
        except RuntimeError as error:  # gloo / NCCL: a closed connection, a timeout
            self._failed = True
            raise self.workers.error(error) from error
        except BaseException:
            # Rank 0 failed on its own (a bug) after the call went out: the workers are in
            # its collectives, out of step with rank 0 for good, and would take no 'stop'
            # until their collectives time out. close() kills them.
            self._failed = True
            raise

    def apply_moves(self, moves: BlockMoves) -> None:
        self._local.apply_moves(moves)
        if moves.swap_out or moves.swap_in or moves.copies:
            self._pending_moves.append(moves)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], scores_prompts: bool = False
                ) -> torch.Tensor:
        """As ModelRunner.execute: through the graphs' buffers when they take the step (the
        workers get what rank 0 wrote into its buffers), else from the step inputs."""
        local = self._local
        if scores_prompts:
            return self.run_batch(local.step_inputs(scheduled, scores_prompts=True))
        for graphs, method in ((local.decode_graphs, "run_decode_graph"),
                               (local.mixed_graphs, "run_mixed_graph")):
            if graphs is not None and graphs.accepts(scheduled):
                step = graphs.prepare(scheduled)
                return self._run(method, (step,), partial(graphs.launch, step))
        return self.run_batch(local.step_inputs(scheduled))

    def run_batch(self, inputs: StepInputs) -> torch.Tensor:
        return self._run("run_batch", (inputs,), lambda: self._local.run_batch(inputs))

    def profile_run(self, num_tokens: int, num_seqs: int) -> int:
        self._local._refuse_if_captured()  # here, before any worker fails on it
        return self._run("profile_run", (num_tokens, num_seqs, self._utilization),
                         lambda: self._local.profile_run(num_tokens, num_seqs))

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self._local._refuse_if_captured()
        self._run("allocate_kv_cache", (num_blocks, num_cpu_blocks),
                  lambda: _allocate_agreed(self._local, self.group, num_blocks,
                                           num_cpu_blocks, None))

    def _refuse_graphs_on_cuda(self) -> None:
        if self._local.device.type == "cuda":
            raise TensorParallelError(
                "CUDA graphs are not captured under tensor parallelism: a graph would hold "
                "the forward's NCCL collectives, which needs a captured communicator and a "
                "deadline on the replay (bench/README.md, 'Tensor parallelism on the CPU')")

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> int:
        """Every rank builds the decode graphs' buffers (off CUDA they run the forward
        eagerly: nothing is captured)."""
        self._refuse_graphs_on_cuda()
        return self._run("capture_decode_graphs", (max_num_seqs, max_model_len),
                         partial(self._local.capture_decode_graphs, max_num_seqs,
                                 max_model_len))

    def capture_mixed_graphs(self, max_num_batched_tokens: int) -> int:
        self._refuse_graphs_on_cuda()
        if self._local.decode_graphs is None:  # refused here, before any worker fails on it
            raise RuntimeError("capture the decode graphs first: the mixed-step graphs share "
                               "their sequence rows")
        return self._run("capture_mixed_graphs", (max_num_batched_tokens,),
                         partial(self._local.capture_mixed_graphs, max_num_batched_tokens))

    def graph_buffer_digests(self) -> list[bytes]:
        """Each rank's digest of its graph buffers, in rank order (tests and debugging: they
        are equal after every step)."""
        return self._run("graph_buffers_digest", (),
                         lambda: self.group.gather_digests(graph_buffers_digest(self._local)))

    def close(self) -> None:
        """Tell the workers to stop, then make sure they have (idempotent)."""
        if self.workers.stopped:
            return
        if self._failed or not self.workers.all_alive():  # no orderly stop: the group is broken
            self.workers.kill()
            return
        try:
            self.channel.send(Call("stop"))
        except RuntimeError:
            pass
        self.workers.stop()
