"""The collectives one tensor-parallel rank calls, over process groups made without
torch.distributed's global default group (several engines may live in one process: tests,
notebooks), so every call names its group.

Two groups share one TCPStore: `compute` (NCCL on CUDA, gloo on the CPU) carries the forward's
all-reduces and the logits gather under a short timeout, so a rank that hangs fails the step;
`control` (always gloo: pickled step inputs are host bytes) carries rank 0's step broadcast
under a long one, since a worker waits on it for as long as the engine has nothing to do.
Rank 0's own send of a step is bounded by the short one, though: gloo completes a send only
once the receiver has posted its receive, so a worker that hangs between two steps would
hold rank 0's send for as long as that long timeout.
"""

import datetime
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine_service.model.parallel.listeners import listening_sockets, refuse_new_connections

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = datetime.timedelta(days=30)  # idle engines: workers wait this long at most
GROUP_NAMES = ("control", "compute")  # each group's keys in the store start with its name
DIGEST_BYTES = 32  # SHA-256 (gather_digests)


def rendezvous_keys(rank: int) -> list[str]:
    """The store keys where `rank` leaves its address for each group to connect to it (the
    group's name, then gloo's: device index 0, then the rank). Rank 0 waits for them; a
    value that is no address fails that wait at once (workers.py, a rank that dies there)."""
    return [f"{name}/0/{rank}" for name in GROUP_NAMES]


@dataclass(slots=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    compute: dist.ProcessGroup
    control: dist.ProcessGroup
    timeout: datetime.timedelta  # the compute collectives', and rank 0's step sends
    # Wall seconds this rank spent in the forward's collectives (waiting for slower ranks
    # included) and how many it ran: bench/tensor_parallel.py reads them. (~0.2 us a call.)
    collective_s: float = 0.0
    num_collectives: int = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (the row-parallel linears' partial sums)."""
        start = time.perf_counter()
        self.compute.allreduce([tensor]).wait()
        self.collective_s += time.perf_counter() - start
        self.num_collectives += 1
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape on each), in rank order, on rank 0; None elsewhere."""
        outputs = ([[torch.empty_like(tensor) for _ in range(self.world_size)]]
                   if self.rank == 0 else [])
        start = time.perf_counter()
        self.compute.gather(outputs, [tensor], dist.GatherOptions()).wait()
        self.collective_s += time.perf_counter() - start
        self.num_collectives += 1
        return outputs[0] if self.rank == 0 else None

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` of all ranks (the KV pool size every rank can hold)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        opts.timeout = self.timeout  # the ranks are in step here, as in a forward
        self.control.allreduce([tensor], opts).wait()
        return int(tensor.item())

    def gather_digests(self, digest: bytes) -> list[bytes] | None:
        """Every rank's `digest` (DIGEST_BYTES), in rank order, on rank 0; None elsewhere. On
        the control group (host bytes), under the short timeout: the ranks are in step."""
        if len(digest) != DIGEST_BYTES:
            raise ValueError(f"a digest is {DIGEST_BYTES} bytes, got {len(digest)}")
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
        outputs = ([[torch.empty_like(mine) for _ in range(self.world_size)]]
                   if self.rank == 0 else [])
        opts = dist.GatherOptions()
        opts.timeout = self.timeout
        self.control.gather(outputs, [mine], opts).wait()
        return [bytes(t.numpy()) for t in outputs[0]] if self.rank == 0 else None

    def broadcast_step(self, tensor: torch.Tensor) -> None:
        """Rank 0's bytes to every rank: rank 0 gives up after `timeout` (a rank that does
        not take them hangs), the others wait as long as the engine idles."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.rank == 0:
            opts.timeout = self.timeout
        self.control.broadcast([tensor], opts).wait()


def _gloo(store: dist.Store, rank: int, world_size: int, host: str,
          timeout: datetime.timedelta, listeners: set[str],
          published: list[bytes]) -> dist.ProcessGroupGloo:
    """A gloo group, connected to every rank; the socket inodes of the listening sockets
    that appeared while its device was made are added to `listeners`, and the address this
    rank published for the group to `published` (listeners.py)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    before = listening_sockets().keys()
    # Bound to the rendezvous host's interface (loopback by default), not whatever the
    # machine's hostname resolves to. Eager whatever TORCH_GLOO_LAZY_INIT says (a user's
    # setting for their own jobs): every pair connects in the group's constructor, while the
    # store is open (it closes after the start) and before the listeners are closed.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host, lazy_init=False)]
    listeners |= listening_sockets().keys() - before
    group = dist.ProcessGroupGloo(store, rank, world_size, options)
    key = f"0/{rank}"  # gloo's: device 0, this rank
    if store.check([key]):
        published.append(store.get(key))
    return group


def connect_group(store: dist.Store, rank: int, world_size: int, device: torch.device,
                  host: str, timeout_s: float) -> TensorParallelGroup:
    """Blocks until every rank has connected (or the store's timeout passes). Rank 0's control
    group has the short timeout (its sends and its connecting to the workers are bounded by
    it); a worker's waits for the next step as long as the engine idles."""
    timeout = datetime.timedelta(seconds=timeout_s)
    listeners: set[str] = set()
    published: list[bytes] = []
    control = _gloo(dist.PrefixStore("control", store), rank, world_size, host,
                    timeout if rank == 0 else CONTROL_TIMEOUT, listeners, published)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", store), rank, world_size,
                                        options)
        # The communicator now (what init_process_group's device_id does), not at the first
        # collective: its unique id crosses the store during the start, and the forward's
        # all-reduces and the logits gather all run on this one communicator, so NCCL needs
        # the store no more (launch.py closes it; nccl_store_users says when it cannot).
        compute.eager_connect_single_device(device)
    else:
        compute = _gloo(dist.PrefixStore("compute", store), rank, world_size, host, timeout,
                        listeners, published)
    # Every pair is connected: gloo's listeners would only take other processes'
    # connections from now on, and keep each one open (listeners.py).
    if not refuse_new_connections(listeners, published):
        log.warning("found no gloo listening socket to close (no /proc, or no address of "
                    "ours in the store's gloo keys): gloo's ports stay open to every local "
                    "process (docs/security.md)")
    return TensorParallelGroup(rank, world_size, compute, control, timeout)
