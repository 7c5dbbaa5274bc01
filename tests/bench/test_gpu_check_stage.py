"""bench/gpu_check.sh's `stage`: a stage stopped by its time limit leaves nothing running.

`timeout` sends SIGTERM to its process group once; pagedgen-engine drains on SIGTERM (up to
30 s) and so outlived the served stage, holding most of the GPU's memory while the next stage
loaded its own 8B model; a grandchild that kept the stage's stdout also kept `tee`, so the
check waited on it. The stage function is cut out of the script and run as it is there.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECK = REPO_ROOT / "bench" / "gpu_check.sh"

# A client that starts a server child (same process group, as EngineProcess does) which
# ignores SIGTERM and shares stdout, then waits; the stage's limit ends it.
CLIENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print(os.getpid(), flush=True); time.sleep(120)"])
time.sleep(120)
"""


def _functions(names: tuple[str, ...]) -> str:
    text = CHECK.read_text()
    return "\n".join(re.search(rf"^{name}\(\) {{\n.*?^}}\n", text, re.DOTALL | re.MULTILINE)
                     .group(0) for name in names)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_stage_cut_short_leaves_no_process(tmp_path):
    script = "\n".join([
        "set -u",
        f"WORK={tmp_path} LOG={tmp_path}/log START=$(date +%s) BUDGET=100 SLOW=1",
        'say() { echo "$*" | tee -a "$LOG"; }',
        "summarize() { :; }",
        _functions(("group_members", "reap_group", "stage")),
        f"stage serve 2 {sys.executable} {tmp_path}/client.py",
        "stage next 5 true",
    ])
    (tmp_path / "client.py").write_text(CLIENT)
    start = time.monotonic()
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    pids = [int(line) for line in out.stdout.splitlines() if line.strip().isdigit()]
    try:
        assert out.returncode == 0, out.stderr
        assert pids, out.stdout
        assert not _alive(pids[0]), f"the server child {pids[0]} outlived its stage"
        assert elapsed < 20, f"the stage took {elapsed:.0f} s for a 2 s limit"
        rows = [line.split("\t") for line in (tmp_path / "stages.tsv").read_text().splitlines()]
        assert [(r[0], r[1]) for r in rows] == [("serve", "124"), ("next", "0")]
        assert "killing what the stage left running" in out.stdout
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, 9)
