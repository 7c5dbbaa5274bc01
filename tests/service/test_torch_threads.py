"""The engine core's torch thread count: one a CPU the process may use (its affinity and its
cgroup's quota, at most torch's own count), unless --torch-threads or OMP_NUM_THREADS says."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_service.serving.torch_threads import cgroup_cpu_quota, core_torch_threads, usable_cpus
from engine_service.tools.launch import EngineProcess


def _cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "200000 100000\n"}, 2.0),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
     3.0),
    ({}, None),
    ({"cpu.max": "garbage\n"}, None),
    ({"cpu.max": "100000 0\n"}, None),  # no period: not a limit, not a ZeroDivisionError
])
def test_the_cgroup_quota_is_read_from_v2_and_v1(tmp_path, files, quota):
    assert cgroup_cpu_quota(_cgroup(tmp_path, files), own="0::/\n") == quota


def test_a_v2_quota_above_the_process_cgroup_holds(tmp_path):
    """A systemd unit's CPUQuota sits in a parent of the process's cgroup; the smallest of the
    chain holds, and a cgroup without cpu.max (the root's) is no limit."""
    unit = "system.slice/pagedgen.service"
    root = _cgroup(tmp_path, {"system.slice/cpu.max": "300000 100000",
                              f"{unit}/cpu.max": "max 100000",
                              f"{unit}/engine/cpu.max": "max 100000"})
    assert cgroup_cpu_quota(root, own=f"0::/{unit}/engine\n") == 3.0
    (root / unit / "cpu.max").write_text("150000 100000")
    assert cgroup_cpu_quota(root, own=f"1:cpu:/\n0::/{unit}/engine\n") == 1.5
    assert cgroup_cpu_quota(root, own="0::/\n") is None  # the root has no cpu.max


def test_a_v1_quota_above_the_process_cgroup_holds(tmp_path):
    """cgroup v1 (or a hybrid host's cpu controller): the quota is read along the process's
    path in the cpu hierarchy too, as v2's is (a systemd unit's CPUQuota on such a host sits
    in the unit's cgroup, not the hierarchy's root, which has none); a path not under the
    mount (a container whose own cgroup is the mount's root) ends at the root's."""
    unit = "system.slice/pagedgen.service"
    root = _cgroup(tmp_path, {"cpu,cpuacct/cpu.cfs_quota_us": "-1",
                              "cpu,cpuacct/cpu.cfs_period_us": "100000",
                              f"cpu,cpuacct/{unit}/cpu.cfs_quota_us": "150000",
                              f"cpu,cpuacct/{unit}/cpu.cfs_period_us": "100000"})
    hybrid = f"5:cpuset:/\n4:cpu,cpuacct:/{unit}\n1:name=systemd:/{unit}\n0::/{unit}\n"
    assert cgroup_cpu_quota(root, own=hybrid) == 1.5
    assert cgroup_cpu_quota(root, own="4:cpu,cpuacct:/\n") is None
    container = _cgroup(tmp_path / "c", {"cpu/cpu.cfs_quota_us": "200000",
                                         "cpu/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(container, own="3:cpu:/docker/0123abcd\n") == 2.0


def test_usable_cpus_is_the_affinity_capped_by_the_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(_cgroup(tmp_path, {})) == affinity
    one_and_a_half = _cgroup(tmp_path / "a", {"cpu.max": "150000 100000"})
    assert usable_cpus(one_and_a_half) == 1  # a second thread would be throttled
    a_tenth = _cgroup(tmp_path / "b", {"cpu.max": "10000 100000"})
    assert usable_cpus(a_tenth) == 1
    many = _cgroup(tmp_path / "c", {"cpu.max": f"{100000 * (affinity + 8)} 100000"})
    assert usable_cpus(many) == affinity


def test_who_decides_the_count(tmp_path):
    two_cpus = _cgroup(tmp_path, {"cpu.max": "200000 100000"})
    # Not told: every CPU it may use, never more than torch's own count (physical cores).
    assert core_torch_threads(None, "cpu", 64, {}, two_cpus, affinity=2) == 2
    assert core_torch_threads(None, "cpu", 1, {}, two_cpus, affinity=2) == 1
    # A quota below the CPUs it may run on is a budget: one CPU of it stays the front's,
    # since time past it is throttled, not shared (a 2-CPU pod of a 64-core node: 1 thread).
    on_a_big_node = dict(affinity=64)
    assert core_torch_threads(None, "cpu", 32, {}, two_cpus, **on_a_big_node) == 1
    four_cpus = _cgroup(tmp_path / "four", {"cpu.max": "400000 100000"})
    assert core_torch_threads(None, "cpu", 32, {}, four_cpus, **on_a_big_node) == 3
    assert core_torch_threads(None, "cpu", 32, {}, four_cpus, affinity=4) == 4  # not binding
    a_tenth = _cgroup(tmp_path / "tenth", {"cpu.max": "10000 100000"})
    assert core_torch_threads(None, "cpu", 32, {}, a_tenth, **on_a_big_node) == 1
    assert core_torch_threads(None, "cpu", 32, {}, tmp_path / "none", **on_a_big_node) == 32
    # The user's: --torch-threads (0 is torch's default as it is), then OMP_NUM_THREADS.
    assert core_torch_threads(3, "cpu", 64, {}, two_cpus) == 3
    assert core_torch_threads(0, "cpu", 64, {}, two_cpus) == 64
    assert core_torch_threads(None, "cpu", 6, {"OMP_NUM_THREADS": "6"}, two_cpus) == 6
    # On CUDA the threads feed the GPU: torch's choice.
    assert core_torch_threads(None, "cuda", 64, {}, two_cpus) == 64


def _core_threads_logged(model_dir: Path, log_path: Path, extra: list[str]) -> str:
    with EngineProcess(model_dir, ["--insecure", "--prefix-index", "none", "--num-blocks", "64",
                                   "--log-level", "INFO", *extra], log_path=log_path):
        pass
    [line] = [line for line in log_path.read_text().splitlines()
              if "torch threads" in line]
    return line


def test_a_served_engine_computes_on_every_cpu_it_may_use(tiny_llama_dir, tmp_path,
                                                          monkeypatch):
    """The shipped default, through a real pagedgen-engine (the suite's workers set
    OMP_NUM_THREADS=1 for the servers they start: unset here), and --torch-threads over it."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch_default = int(subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True, text=True, check=True).stdout)
    expected = core_torch_threads(None, "cpu", torch_default, {})
    line = _core_threads_logged(tiny_llama_dir, tmp_path / "default.log", [])
    assert f"computes with {expected} torch threads (--torch-threads: not given)" in line
    line = _core_threads_logged(tiny_llama_dir, tmp_path / "one.log", ["--torch-threads", "1"])
    assert "computes with 1 torch threads (--torch-threads: 1)" in line


def test_the_stack_shares_the_cpus_out_among_its_cpu_replicas():
    from engine_service.tools.stack import replica_threads

    cpus = usable_cpus()
    assert replica_threads("cpu", 1, {}) == []  # one engine: all of them (its own default)
    assert replica_threads("cpu", 2, {}) == ["--torch-threads", str(max(1, cpus // 2))]
    assert replica_threads("cpu", 16, {}) == ["--torch-threads", str(max(1, cpus // 16))]
    assert replica_threads("cpu", 3, {"OMP_NUM_THREADS": "4"}) == []
    assert replica_threads("cuda", 3, {}) == []


def test_a_cpu_tensor_parallel_engine_says_the_threads_its_rank_0_computes_with(tiny_llama_dir,
                                                                                tmp_path,
                                                                                monkeypatch):
    """Rank 0 of a CPU tensor-parallel engine computes with PAGEDGEN_TP_THREADS (one a rank by
    default), set as the model is split, after the core's own default: the log says that
    count, not the one it replaced. And the engine still starts and generates."""
    import grpc

    from pagedgen_api import generation_pb2 as pb
    from pagedgen_api import generation_pb2_grpc as pb_grpc

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("PAGEDGEN_TP_THREADS", raising=False)
    log_path = tmp_path / "tp.log"
    request = pb.GenerateRequest(text="The capital of France is",
                                 sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True,
                                                            temperature=0))
    with EngineProcess(tiny_llama_dir, ["--insecure", "--prefix-index", "none",
                                        "--tensor-parallel-size", "2", "--dtype", "float32",
                                        "--num-blocks", "64", "--log-level", "INFO"],
                       log_path=log_path) as engine:
        with grpc.insecure_channel(engine.target) as channel:
            reply = pb_grpc.GenerationStub(channel).Generate(request, timeout=120)
    assert len(reply.completions[0].token_ids) == 8
    [line] = [line for line in log_path.read_text().splitlines() if "torch threads" in line]
    assert "computes with 1 torch threads" in line, line
