"""How many KV cache blocks fit on the device: the arithmetic, as pure functions.

The plan follows vLLM's GPU worker: the engine may use `gpu_memory_utilization` of the device's
total memory; out of that come the weights (already loaded), the peak activations of a
profiling forward at `max_num_batched_tokens`, the decode CUDA graphs' own memory (when they
are captured), the memory the process holds outside torch's allocator (CUDA context, cuBLAS
workspaces, other processes on the same device) and a safety margin; what is left is the KV
pool. `engine_service/model/kv_cache_setup.py` measures the inputs; everything here is
arithmetic on byte counts, so it is tested without a GPU.
"""

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30
# Headroom the profile cannot see: allocator fragmentation between steps, the sampler's
# temporaries at odd batch shapes, and workspaces libraries grow lazily after the first step.
DEFAULT_MARGIN_BYTES = 512 * MiB
MIN_KV_BLOCKS = 2  # one sequence needs at least one block, and one more to make progress


class InsufficientDeviceMemoryError(ValueError):
    """The model (or the model plus its activations) does not fit in the memory allowed."""


def format_bytes(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The KV pool size and the figures it was derived from (bytes, except num_blocks)."""

    total_bytes: int  # the device's memory
    utilization: float  # the fraction of total_bytes the engine may use
    budget_bytes: int  # utilization x total_bytes
    weights_bytes: int  # what the loaded model holds on the device
    peak_activation_bytes: int  # the profiling forward's peak above the weights
    cuda_graph_bytes: int  # kept for the decode CUDA graphs (0 without them)
    non_torch_bytes: int  # device memory in use outside torch's allocator
    margin_bytes: int
    block_bytes: int  # one KV block, every layer, K and V
    num_blocks: int

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def used_bytes(self) -> int:
        """Everything the plan expects to be in use once the pool is allocated."""
        return (
            self.weights_bytes
            + self.peak_activation_bytes
            + self.cuda_graph_bytes
            + self.non_torch_bytes
            + self.margin_bytes
            + self.kv_bytes
        )

    def describe(self) -> str:
        """The arithmetic, for the log."""
        return (
            f"KV cache: {self.utilization:g} x {format_bytes(self.total_bytes)} total = "
            f"{format_bytes(self.budget_bytes)} budget - {format_bytes(self.weights_bytes)} "
            f"weights - {format_bytes(self.peak_activation_bytes)} peak activations - "
            f"{format_bytes(self.cuda_graph_bytes)} CUDA graphs - "
            f"{format_bytes(self.non_torch_bytes)} outside torch - "
            f"{format_bytes(self.margin_bytes)} margin = {format_bytes(self.kv_bytes)} "
            f"= {self.num_blocks} blocks of {self.block_bytes / MiB:.2f} MiB"
        )


def memory_budget(total_bytes: int, utilization: float) -> int:
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    if total_bytes <= 0:
        raise ValueError(f"total device memory must be positive, got {total_bytes} bytes")
    return int(total_bytes * utilization)


def check_weights_fit(weights_bytes: int, free_bytes: int, total_bytes: int) -> None:
    """Refuse, before loading, a model whose weights exceed the device's free memory (instead
    of an out-of-memory error halfway through the load)."""
    if weights_bytes > free_bytes:
        raise InsufficientDeviceMemoryError(
            f"model weights need {format_bytes(weights_bytes)} but the device has "
            f"{format_bytes(free_bytes)} free of {format_bytes(total_bytes)}: use a smaller "
            "model or dtype, or a larger device"
        )


def plan_kv_cache(
    *,
    total_bytes: int,
    utilization: float,
    weights_bytes: int,
    peak_activation_bytes: int,
    non_torch_bytes: int,
    block_bytes: int,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
    cuda_graph_bytes: int = 0,
) -> MemoryPlan:
    """The largest pool that keeps weights + activations + pool + the rest within budget."""
    for name, value in (
        ("weights_bytes", weights_bytes),
        ("peak_activation_bytes", peak_activation_bytes),
        ("cuda_graph_bytes", cuda_graph_bytes),
        ("non_torch_bytes", non_torch_bytes),
        ("margin_bytes", margin_bytes),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    budget = memory_budget(total_bytes, utilization)
    if weights_bytes > budget:
        raise InsufficientDeviceMemoryError(
            f"model weights need {format_bytes(weights_bytes)} but gpu_memory_utilization "
            f"{utilization:g} of this device's {format_bytes(total_bytes)} allows "
            f"{format_bytes(budget)}: use a smaller model or dtype, or a larger device"
        )
    left = (budget - weights_bytes - peak_activation_bytes - cuda_graph_bytes
            - non_torch_bytes - margin_bytes)
    num_blocks = max(left, 0) // block_bytes
    plan = MemoryPlan(
        total_bytes=total_bytes,
        utilization=utilization,
        budget_bytes=budget,
        weights_bytes=weights_bytes,
        peak_activation_bytes=peak_activation_bytes,
        cuda_graph_bytes=cuda_graph_bytes,
        non_torch_bytes=non_torch_bytes,
        margin_bytes=margin_bytes,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
    )
    if num_blocks < MIN_KV_BLOCKS:
        raise InsufficientDeviceMemoryError(
            f"no room for the KV cache ({MIN_KV_BLOCKS} blocks of "
            f"{block_bytes / MiB:.2f} MiB needed): {plan.describe()}. Lower "
            "max_num_batched_tokens, raise gpu_memory_utilization, or use a larger device"
        )
    return plan


def blocks_in(kv_cache_memory: int, block_bytes: int) -> int:
    """Blocks in an explicit KV budget (`kv_cache_memory`, or the CPU default)."""
    num_blocks = kv_cache_memory // block_bytes
    if num_blocks < MIN_KV_BLOCKS:
        raise ValueError(
            f"kv_cache_memory must hold at least {MIN_KV_BLOCKS} blocks "
            f"({MIN_KV_BLOCKS * block_bytes} bytes), got {kv_cache_memory}"
        )
    return num_blocks
