"""bench.compare on the committed results of two machines, and on files it must refuse."""

import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def _compare(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.compare", *map(str, paths)],
                          capture_output=True, text=True, timeout=120)


def test_two_machines_side_by_side():
    done = _compare(RESULTS / "bench.json", RESULTS / "xeon_amx" / "bench.json")
    assert done.returncode == 0, done.stderr
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in done.stdout.splitlines() if line.startswith("| ")}
    assert rows["CPU"] == ["AMD EPYC", "Intel(R) Xeon(R) Processor"]
    xeon = json.loads((RESULTS / "xeon_amx" / "bench.json").read_text())
    expected = xeon["ratios"]["engine_offline/hf_generate_static"]
    assert rows["engine fp32 / HF static fp32"][1] == f"{expected:.2f}x"
    assert rows["bf16 linears"][1] == xeon["meta"]["cpu_bf16_linear"]
    assert rows["engine / llama.cpp fp32, 32 concurrent"][0] != "-"


def test_files_that_are_not_results_are_refused_naming_them(tmp_path):
    scalar = tmp_path / "scalar.json"
    scalar.write_text("42")
    no_peaks = tmp_path / "no_peaks.json"
    no_peaks.write_text(json.dumps({"meta": {"cpu": "x"}, "peers": {}}))
    for bad, says in ((tmp_path / "missing.json", "missing.json"), (scalar, "not a pagedgen"),
                      (no_peaks, "no matmul peak")):
        done = _compare(RESULTS / "bench.json", bad)
        assert done.returncode == 2 and says in done.stderr, done.stderr
