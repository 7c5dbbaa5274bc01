"""The servers run as the Kubernetes manifests run them, on a read-only root with an emptyDir
at /tmp (readOnlyRootFilesystem): an engine and a router serve a stream, and nothing they do
fails on the read-only root. Run here in a mount namespace of our own (root's `unshare`): /
bound read-only, a fresh tmpfs at /tmp, the checkout, the model and the compiled kernels (the
image's /extensions emptyDir) bound in, the log folder writable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu_extension import _cache_root
from prefix_index.tools.redis_process import free_port

ROOT = Path(__file__).resolve().parents[2]

CLIENT = """
import grpc
from pagedgen_api import generation_pb2 as pb, generation_pb2_grpc as g
stub = g.GenerationStub(grpc.insecure_channel("127.0.0.1:{port}"))
request = pb.GenerateRequest(text="Hello", sampling=pb.SamplingParams(max_tokens=6,
                                                                      ignore_eos=True))
tokens = sum(len(m.choices[0].token_ids) for m in stub.GenerateStream(request, timeout=60)
             if m.choices)
print("streamed tokens:", tokens)
"""


# Its own PID namespace too: when the script ends, however it ends (a failed step under
# set -e, the timeout killing unshare), every server it started ends with it.
UNSHARE = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private"]


def _can_unshare(scratch: Path) -> bool:
    """Whether this machine lets the test make the namespace: root, unshare, and mount inside
    (a container may allow the first two and deny mounts)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    scratch.mkdir()
    probe = subprocess.run([*UNSHARE, "mount", "-t", "tmpfs", "tmpfs", str(scratch)],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def test_engine_and_router_serve_on_a_read_only_root(tiny_llama_dir, tmp_path):
    if not _can_unshare(tmp_path / "probe"):
        pytest.skip("needs root, unshare and mount (mount and PID namespaces) to make / "
                    "read-only")
    extensions = _cache_root()  # the kernels this checkout built (setup), bound in writable
    extensions.mkdir(parents=True, exist_ok=True)
    logs = tmp_path / "logs"
    logs.mkdir()
    new_root = tmp_path / "root"
    new_root.mkdir()
    engine_port, router_port = free_port(), free_port()
    python = sys.executable
    binds = [(ROOT, "ro"), (tiny_llama_dir, "ro"), (extensions, "rw"), (logs, "rw")]
    # The environment each container has in deploy/kubernetes (the engine's caches and HOME
    # in /tmp; the router's HOME read-only, as there); the kernels are this checkout's.
    engine_env = (f"HOME=/tmp PAGEDGEN_CACHE_DIR=/tmp/cache "
                  f"PAGEDGEN_EXTENSIONS_DIR={extensions} OMP_NUM_THREADS=1")
    inner = f"""
set -e
cd {ROOT}
env {engine_env} {python} -m engine_service.serving.server --model {tiny_llama_dir} \
    --insecure --port {engine_port} --prefix-index none --num-blocks 64 --dtype float32 \
    > {logs}/engine.log 2>&1 &
{python} -m router.server --engines 127.0.0.1:{engine_port} --insecure --port {router_port} \
    > {logs}/router.log 2>&1 &
for i in $(seq 120); do
  {python} -m engine_service.tools.launch --check 127.0.0.1:{router_port} --insecure \
      > /dev/null 2>&1 && break
  sleep 1
done
{python} -c '{CLIENT.format(port=router_port)}'
kill %1 %2
wait
"""
    mounts = [f"mount --bind / {new_root}", f"mount -o remount,bind,ro {new_root}",
              f"mount -t proc proc {new_root}/proc",  # (this PID namespace's)
              f"mount --rbind /dev {new_root}/dev",
              f"mount -t tmpfs tmpfs {new_root}/tmp"]
    for path, mode in binds:
        mounts += [f"mkdir -p {new_root}{path}", f"mount --bind {path} {new_root}{path}"]
        if mode == "ro":
            mounts.append(f"mount -o remount,bind,ro {new_root}{path}")
    script = " && ".join(mounts) + f" && exec chroot {new_root} bash -c {_quoted(inner)}"
    done = subprocess.run([*UNSHARE, "bash", "-c", script], capture_output=True, text=True,
                          timeout=300)
    engine_log = (logs / "engine.log").read_text()
    router_log = (logs / "router.log").read_text()
    assert done.returncode == 0 and "streamed tokens: 6" in done.stdout, (
        done.stdout, done.stderr, engine_log[-3000:], router_log[-3000:])
    for log in (engine_log, router_log):
        assert "Read-only file system" not in log, log[-3000:]


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"
