"""Engine configuration: one slotted dataclass, validated on construction."""

from dataclasses import dataclass
from pathlib import Path

from engine_service.model.dtype import DTYPE_CHOICES, resolve_dtype

BLOCK_SIZES = (8, 16, 32, 64)
PREEMPTION_MODES = ("recompute", "swap")
DEVICES = ("cpu", "cuda")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB of KV on the CPU unless told otherwise
MAX_SERVED_NAME = 256
MAX_TENSOR_PARALLEL_TIMEOUT_S = 86400


def default_served_model_name(model: str) -> str:
    """The model directory's name, or a GGUF file's name without its suffix; spaces and other
    unprintable characters become '-' (a name is one token in URLs, logs and metrics)."""
    path = Path(model).expanduser()
    name = (path.stem if path.suffix == ".gguf" else path.resolve().name) or "model"
    return "".join(c if c.isprintable() and not c.isspace() else "-" for c in name)


@dataclass(slots=True)
class EngineConfig:
    model: str
    block_size: int = 16
    num_blocks: int | None = None  # KV pool size in blocks; wins over kv_cache_memory
    kv_cache_memory: int | None = None  # KV pool size in bytes
    gpu_memory_utilization: float = 0.9  # CUDA only, when neither of the above is given
    device: str = "cpu"
    # "auto" is resolved in __post_init__ (engine_service/model/dtype.py): after construction
    # dtype is always a concrete name, the one the engine runs, reports and hashes blocks with.
    dtype: str = "auto"
    kernel_backend: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: int = 1 << 30  # bytes of CPU blocks for swapped-out sequences (swap mode)
    seed: int = 0
    # Serve token ids only: no tokenizer is loaded, text input is refused, outputs carry ids.
    skip_tokenizer_init: bool = False
    # False: the engine makes no text (outputs carry token ids; stop strings are matched by
    # whoever detokenizes and call finish_sequence): the serving front does it, in its own
    # process (engine_service/serving/output_text.py).
    detokenize: bool = True
    # CUDA: run decode steps eagerly, without the captured CUDA graphs (a debugging switch).
    enforce_eager: bool = False
    # A waiting request whose next prompt block a running request is computing waits a step
    # and finds it cached (core/scheduler.py); False computes it again in the same step, as
    # before (the benchmark's baseline).
    defer_shared_prefill: bool = True
    # What clients name the model by (ModelInfo, the HTTP API's /v1/models) and, with a
    # fingerprint of the weights' content, what seeds block hashes; None: the model directory's
    # name (a GGUF file's name without .gguf).
    served_model_name: str | None = None
    # Ranks of one engine (engine_service/model/parallel): rank 0 is this engine, the others
    # worker processes holding their shards of the weights and of every KV block.
    tensor_parallel_size: int = 1
    # Seconds a rank waits in a forward's collective before the engine fails (a hung rank).
    tensor_parallel_timeout_s: float = 60.0
    # The pin budget (core/pin_budget.py): the pool minus the running requests' peak demand
    # over the last pin_budget_window_s seconds, between these shares of the pool. Floor =
    # ceiling fixes it (0.1: the fixed budget pins had before it followed the demand).
    pin_budget_floor: float = 0.1
    pin_budget_ceiling: float = 0.5
    pin_budget_window_s: float = 30.0

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, value: object, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{field} must be {allowed}, got {value!r}")

        need(self.block_size in BLOCK_SIZES, "block_size", self.block_size, f"one of {BLOCK_SIZES}")
        need(
            self.num_blocks is None or (isinstance(self.num_blocks, int) and self.num_blocks >= 2),
            "num_blocks",
            self.num_blocks,
            "None or an int >= 2",
        )
        need(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            "kv_cache_memory",
            self.kv_cache_memory,
            "None or a positive number of bytes",
        )
        need(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "in (0, 1]",
        )
        need(self.device in DEVICES, "device", self.device, f"one of {DEVICES}")
        need(isinstance(self.enforce_eager, bool), "enforce_eager", self.enforce_eager,
             "True or False")
        need(isinstance(self.defer_shared_prefill, bool), "defer_shared_prefill",
             self.defer_shared_prefill, "True or False")
        need(self.dtype in DTYPE_CHOICES, "dtype", self.dtype, f"one of {DTYPE_CHOICES}")
        self.dtype = resolve_dtype(self.dtype, self.device, self.model)
        need(
            self.kernel_backend in ("auto", "torch", "triton"),
            "kernel_backend",
            self.kernel_backend,
            "one of ('auto', 'torch', 'triton')",
        )
        need(
            isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
            "max_num_seqs",
            self.max_num_seqs,
            "an int >= 1",
        )
        need(
            isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "an int >= 1",
        )
        need(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            self.max_model_len,
            "None or an int >= 1",
        )
        need(
            self.preemption_mode in PREEMPTION_MODES,
            "preemption_mode",
            self.preemption_mode,
            f"one of {PREEMPTION_MODES}",
        )
        tp = self.tensor_parallel_size
        need(isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1,
             "tensor_parallel_size", tp, "an int >= 1")
        # Finite and at most a day: it is what bounds a hung rank's wait, in gloo's and NCCL's
        # milliseconds (an infinite one bounds nothing and overflows them).
        timeout_s = self.tensor_parallel_timeout_s
        need(isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
             and 0 < timeout_s <= MAX_TENSOR_PARALLEL_TIMEOUT_S, "tensor_parallel_timeout_s",
             timeout_s, f"a finite number of seconds > 0 and at most "
                        f"{MAX_TENSOR_PARALLEL_TIMEOUT_S}")
        need(self.swap_space >= 0, "swap_space", self.swap_space, "a number of bytes >= 0")
        for name in ("pin_budget_floor", "pin_budget_ceiling"):
            value = getattr(self, name)
            need(not isinstance(value, bool) and isinstance(value, int | float)
                 and 0 <= value <= 1, name, value, "a share of the pool in [0, 1]")
        need(self.pin_budget_floor <= self.pin_budget_ceiling, "pin_budget_floor",
             self.pin_budget_floor, f"<= pin_budget_ceiling ({self.pin_budget_ceiling})")
        window = self.pin_budget_window_s
        need(not isinstance(window, bool) and isinstance(window, int | float)
             and 0 <= window < float("inf"), "pin_budget_window_s", window,
             "a finite number of seconds >= 0")
        if self.served_model_name is None:
            self.served_model_name = default_served_model_name(self.model)
        name = self.served_model_name
        need(isinstance(name, str) and 0 < len(name) <= MAX_SERVED_NAME
             and name.isprintable() and not any(c.isspace() for c in name),
             "served_model_name", name,
             f"1 to {MAX_SERVED_NAME} printable characters without spaces")
