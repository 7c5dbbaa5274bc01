"""Counts what one engine step asks of the device: aten ops (kernel launches on a GPU), host
syncs and host->device uploads, by phase of the step.

Two torch modes run together while the step runs. The dispatch mode sees every aten op after
autograd, so it counts launches and the ops whose output size depends on the data (nonzero,
unique, boolean indexing: each waits for the device on CUDA). The function mode sees the
Python-level calls that move data between host and device: tolist / item / bool / cpu (a
device->host sync) and torch.tensor / as_tensor from host data (a host->device copy on CUDA).
On the CPU the same calls happen; only their cost differs, which is why they are counted
here, where CI runs.

Phases come from real hooks on the real objects: "forward" between the model's forward pre-
and post-hooks, "kernel" inside a kernel-backend call (the backend's functions wrapped to mark
the phase, then called), "layer_ops" inside the backend's norms, rotary and SiLU * up, "step"
elsewhere (input preparation, lm_head, sampling).
"""

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Metadata-only ops: no kernel runs on any device.
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select", "t",
    "transpose", "expand", "unsqueeze", "squeeze", "as_strided", "permute", "detach", "alias",
    "lift_fresh", "unbind", "narrow", "_reshape_alias", "empty", "empty_like", "new_empty",
})
# aten ops whose output shape depends on device data: the host waits for the device.
SYNCING_ATEN_OPS = frozenset({
    "_local_scalar_dense", "nonzero", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "masked_select", "repeat_interleave",
})
DEVICE_TO_HOST_METHODS = frozenset({"tolist", "item", "cpu", "numpy", "__bool__", "__int__",
                                    "__float__"})
HOST_TO_DEVICE_FUNCTIONS = frozenset({"tensor", "as_tensor", "from_numpy"})


@dataclass
class PhaseCounts:
    launches: Counter = field(default_factory=Counter)  # aten op name -> count
    syncs: list[str] = field(default_factory=list)  # what forced each device->host wait
    uploads: list[str] = field(default_factory=list)  # host data turned into tensors

    @property
    def num_launches(self) -> int:
        return sum(self.launches.values())


@dataclass
class StepOps:
    phases: dict[str, PhaseCounts] = field(default_factory=dict)
    kernel_calls: Counter = field(default_factory=Counter)  # kernel-backend function -> calls
    _stack: list[str] = field(default_factory=lambda: ["step"])

    def current(self) -> PhaseCounts:
        return self.phases.setdefault(self._stack[-1], PhaseCounts())

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()

    def get(self, name: str) -> PhaseCounts:
        return self.phases.get(name, PhaseCounts())


def _aliases_input(name: str, args: tuple, out: object) -> bool:
    """An out-of-place op that returned (a view of) its input ran no kernel: `x.float()` on a
    float32 tensor, `contiguous()` of a contiguous one."""
    if name.endswith("_") or not isinstance(out, torch.Tensor) or not args:
        return False
    first = args[0]
    return (isinstance(first, torch.Tensor) and first.device.type != "meta"
            and out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())


class _Dispatch(TorchDispatchMode):
    def __init__(self, ops: StepOps) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        counts = self.ops.current()
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ())
        )
        if name in SYNCING_ATEN_OPS or bool_index:
            counts.syncs.append(f"aten.{name}")
        out = func(*args, **(kwargs or {}))
        if name not in VIEW_OPS and not _aliases_input(name, args, out):
            counts.launches[name] += 1
        return out


class _Function(TorchFunctionMode):
    def __init__(self, ops: StepOps) -> None:
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in DEVICE_TO_HOST_METHODS:
            self.ops.current().syncs.append(f"Tensor.{name}")
        elif name in HOST_TO_DEVICE_FUNCTIONS:
            self.ops.current().uploads.append(f"torch.{name}")
        return func(*args, **(kwargs or {}))


def _mark(ops: StepOps, name: str, fn: Callable) -> Callable:
    def marked(*args, **kwargs):
        ops.kernel_calls[name] += 1
        with ops.phase("kernel"):
            return fn(*args, **kwargs)
    return marked


def _in_phase(ops: StepOps, phase: str, fn: Callable) -> Callable:
    def marked(*args, **kwargs):
        with ops.phase(phase):
            return fn(*args, **kwargs)
    return marked


@contextmanager
def count_ops(ops: StepOps) -> Iterator[StepOps]:
    """Count the ops of whatever runs inside into ops (phase "step" unless marked)."""
    with _Function(ops), _Dispatch(ops):
        yield ops


@contextmanager
def count_step_ops(runner) -> Iterator[StepOps]:
    """Count the ops of whatever runs inside, by phase, for this model runner."""
    ops = StepOps()
    model, original_kernels = runner.model, runner.kernels
    def enter_forward(*_: object) -> None:
        ops._stack.append("forward")

    def leave_forward(*_: object) -> None:  # returns None: the model's output is kept
        ops._stack.pop()

    pre = model.register_forward_pre_hook(enter_forward)
    post = model.register_forward_hook(leave_forward)
    layer_ops = original_kernels.layer_ops
    runner.kernels = replace(original_kernels, **{
        f.name: _mark(ops, f.name, getattr(original_kernels, f.name))
        for f in fields(original_kernels)
        # (plain settings such as fused_layers are not calls)
        if f.name != "layer_ops" and callable(getattr(original_kernels, f.name))
    }, layer_ops=replace(layer_ops, **{
        # Norms, rotary, SiLU * up: their aten ops in a phase of their own, "layer_ops" (torch
        # ops on the torch path; on the Triton path, the interpreter's own copies, while the
        # launches are kernels.launch_counter's).
        f.name: _in_phase(ops, "layer_ops", getattr(layer_ops, f.name))
        for f in fields(layer_ops) if getattr(layer_ops, f.name) is not None
    }))
    try:
        with count_ops(ops):
            yield ops
    finally:
        runner.kernels = original_kernels
        pre.remove()
        post.remove()
