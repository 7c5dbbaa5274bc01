"""How many torch threads the engine core computes with, unless told (`--torch-threads`).

On the CPU: one a core this process may run on. That is torch's own count (physical cores, or
OMP_NUM_THREADS), capped by what the process is allowed: its CPU affinity and its cgroup's CPU
quota. Torch counts the machine's cores, so in a container limited to 2 CPUs of a 64-core node
it would start 64 threads, which the quota then throttles mid-step. Where the quota is what
limits the count, one CPU of it is left to the front (core_torch_threads says why).

Every core, not every core but the front's: the front's work per step (grpcio, text) is short
next to a real model's step, and leaving a core to it cost more than it saved. SmolLM2 over
gRPC on this 2-core machine, quiet (bench/README, "SmolLM2 over gRPC"): 32 streams x 64 tokens
at 168-170 tokens/s with 2 threads against 103-111 with 1; one stream at 30-33 against 19-21.
On a machine that other busy processes share, fewer threads than cores hold up better (a
descheduled thread stalls the others at every op's barrier): set --torch-threads then.

On CUDA the threads only feed the GPU: torch's choice.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


V1_CPU_FOLDERS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")  # where hosts mount v1's cpu controller


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, own: str | None = None) -> float | None:
    """CPUs this process's cgroup may use per period (quota / period), None without a limit.

    cgroup v2: cpu.max ("max 100000" or "200000 100000"), else v1 (or a hybrid host's cpu
    controller): cpu.cfs_quota_us over cpu.cfs_period_us (-1: none). Either is read in the
    process's own cgroup and each above it, the smallest holding (a systemd unit's CPUQuota
    sits in a parent); inside a container's cgroup namespace, or where its own cgroup is
    mounted as the root, the walk ends at the mount's root, which holds the container's limit.
    own: /proc/self/cgroup's text (read when None)."""
    if own is None:
        try:
            own = Path("/proc/self/cgroup").read_text()
        except OSError:
            own = ""
    quota = _smallest_along(root, _own_path(own, None), _v2_quota)
    if quota is not None:
        return quota
    for name in V1_CPU_FOLDERS:
        quota = _smallest_along(root / name, _own_path(own, "cpu"), _v1_quota)
        if quota is not None:
            return quota
    return None


def _own_path(own: str, controller: str | None) -> str:
    """The process's cgroup in /proc/self/cgroup: v2's ("0::path") when controller is None,
    else the v1 hierarchy's that lists it ("4:cpu,cpuacct:path"); "/" if none does."""
    for line in own.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        if controller is None and fields[0] == "0" and not fields[1]:
            return fields[2]
        if controller is not None and controller in fields[1].split(","):
            return fields[2]
    return "/"


def _smallest_along(top: Path, path: str,
                    read: Callable[[Path], float | None]) -> float | None:
    """The smallest quota `read` finds in top/path and each folder above it, up to top."""
    folder, quotas = top / path.strip().lstrip("/"), []
    while True:
        quota = read(folder)
        if quota is not None:
            quotas.append(quota)
        if folder == top or top not in folder.parents:
            break
        folder = folder.parent
    return min(quotas, default=None)


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return _cpus(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        return _cpus(int((folder / "cpu.cfs_quota_us").read_text()),
                     int((folder / "cpu.cfs_period_us").read_text()))
    except (OSError, ValueError):
        return None


def _cpus(quota_us: int, period_us: int) -> float | None:
    """CPUs a quota per period allows; None for no limit (v1's -1) or a period of 0."""
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def usable_cpus(root: Path = CGROUP_ROOT, affinity: int | None = None) -> int:
    """CPUs this process may run on at once: its affinity, capped by its cgroup's quota (a
    quota of 1.5 CPUs is 1: a second thread would be throttled half of each period)."""
    count = _affinity() if affinity is None else affinity
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    return count


def core_torch_threads(requested: int | None, device: str, torch_default: int,
                       environ: Mapping[str, str] = os.environ,
                       root: Path = CGROUP_ROOT, affinity: int | None = None) -> int:
    """The core's torch thread count. requested: --torch-threads (None: not given; 0: torch's
    default as it is). torch_default: torch.get_num_threads() before any setting."""
    if requested is not None:
        return requested or torch_default
    if device != "cpu" or environ.get("OMP_NUM_THREADS"):
        return torch_default  # on CUDA torch's; OMP_NUM_THREADS is the user's own choice
    affinity = _affinity() if affinity is None else affinity
    cpus = usable_cpus(root, affinity)
    if cpus < affinity:
        # A cgroup quota sets the count: a budget, not cores shared with the front. CPU time
        # past it is not lent by anyone but throttled for the rest of the period, and threads
        # that spin at every op's barrier spend all of theirs; so one CPU of it stays the
        # front's (gRPC, text), as the Kubernetes overlay's --torch-threads=1 of 2 CPUs did.
        cpus -= 1
    return max(1, min(torch_default, cpus))
