"""How many torch threads the engine core computes with, unless told (`--torch-threads`).

On the CPU: one a core this process may run on. That is torch's own count (physical cores, or
OMP_NUM_THREADS), capped by what the process is allowed: its CPU affinity and its cgroup's CPU
quota. Torch counts the machine's cores, so in a container limited to 2 CPUs of a 64-core node
it would start 64 threads, which the quota then throttles mid-step.

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
from collections.abc import Mapping
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, own: str | None = None) -> float | None:
    """CPUs this process's cgroup may use per period (quota / period), None without a limit.

    cgroup v2: cpu.max ("max 100000" or "200000 100000") of the process's own cgroup and each
    above it (the smallest holds: a systemd unit's CPUQuota sits in a parent); inside a
    container's cgroup namespace that cgroup is the root of the mount. Else v1's
    cpu.cfs_quota_us (-1: none). own: /proc/self/cgroup's text (read when None)."""
    if own is None:
        try:
            own = Path("/proc/self/cgroup").read_text()
        except OSError:
            own = ""
    v2_path = next((line[3:] for line in own.splitlines() if line.startswith("0::")), "/")
    folder, quotas = root / v2_path.strip().lstrip("/"), []
    while True:
        try:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
            if quota != "max":
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
        if folder == root or root not in folder.parents:
            break
        folder = folder.parent
    if quotas:
        return min(quotas)
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        try:
            quota_us = int((root / name / "cpu.cfs_quota_us").read_text())
            period_us = int((root / name / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on at once: its affinity, capped by its cgroup's quota (a
    quota of 1.5 CPUs is 1: a second thread would be throttled half of each period)."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    return count


def core_torch_threads(requested: int | None, device: str, torch_default: int,
                       environ: Mapping[str, str] = os.environ,
                       root: Path = CGROUP_ROOT) -> int:
    """The core's torch thread count. requested: --torch-threads (None: not given; 0: torch's
    default as it is). torch_default: torch.get_num_threads() before any setting."""
    if requested is not None:
        return requested or torch_default
    if device != "cpu" or environ.get("OMP_NUM_THREADS"):
        return torch_default  # on CUDA torch's; OMP_NUM_THREADS is the user's own choice
    return max(1, min(torch_default, usable_cpus(root)))
