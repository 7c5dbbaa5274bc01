"""bench.front_overhead's --baseline: the flags another checkout's server is given so it serves
as this checkout's does in the bench (plain text, one torch thread in the core)."""

from pathlib import Path

from bench.front_overhead import baseline_flags

ROOT = Path(__file__).resolve().parents[1]


def _checkout(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_checkout_gets_only_the_flags_its_server_has(tmp_path):
    # Before TLS and the front/core split: plain text without a flag, torch's threads as set by
    # OMP_NUM_THREADS (one process): no flag, or its server refuses to start.
    before = _checkout(tmp_path / "before", {
        "engine_service/serving/server.py": 'p.add_argument("--max-live-requests")\n'})
    assert baseline_flags(before) == []
    # After both, before the core honoured OMP_NUM_THREADS (13c7dc3): its --torch-threads
    # default (every core but one) overrode the one thread every measured process gets.
    split = _checkout(tmp_path / "split", {
        "trust/cli_args.py": 'g.add_argument("--insecure", action="store_true")\n',
        "engine_service/serving/server.py": 'p.add_argument("--torch-threads", type=int)\n'})
    assert baseline_flags(split) == ["--insecure", "--torch-threads", "1"]


def test_this_checkout_as_a_baseline_gets_both():
    assert baseline_flags(ROOT) == ["--insecure", "--torch-threads", "1"]
