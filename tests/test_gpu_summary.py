"""The GPU check's summary (bench/gpu_summary.py) on synthetic stage output: one entry per
target, each ratio against the limit measured in the same run, `met` from the target, and
nothing guessed for a stage that did not run. Also the byte counts the bounds rest on, the
checkpoint writer's file format, and the limits stage's dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import gpu_summary
from bench.gpu_common import DecoderShape, card_spec, causal_pairs, device_slug
from bench.random_checkpoint import LLAMA_8B, pad_tokenizer, write_safetensors

BW = 3000.0  # GB/s, the synthetic run's measured read bandwidth
PEAK = 800.0  # TFLOP/s, its measured bf16 GEMM peak


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def _stages(tmp_path: Path, with_peer: bool = True) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    _write(d / "limits.json", {
        "stage": "limits", "dry": False, "complete": True,
        "device": {"name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"},
        "device_slug": "h100-80gb-hbm3",
        "spec": {"name": "H100 SXM5", "read_gb_per_s": 3350, "bf16_tflops": 989},
        "read": {"gb_per_s": BW}, "gemm": {"tflops": PEAK}, "copy": {"gb_per_s": 2900.0},
    })
    _write(d / "decode.json", {
        "stage": "decode", "dry": False, "complete": True,
        "decode": [
            # 15 GB at 3000 GB/s is 5 ms: 5.5 ms is 0.909 of the bound (>= 0.85: met).
            {"name": "decode b1 ctx512", "role": "batch1", "step_ms": 5.5, "replay_ms": 5.2,
             "bytes": 15e9},
            # 18 GB: bound 6 ms; 8.4 ms is 1.4x (> 1.3: not met).
            {"name": "decode b64 ctx512", "role": "batch64", "step_ms": 8.4,
             "replay_ms": None, "bytes": 18e9},
            {"name": "decode b256 ctx512", "role": None, "step_ms": 12.0, "bytes": 30e9},
        ],
        "mixed": [
            # bytes 15e9 -> 5 ms; FLOPs 8e12 -> 10 ms at 800 TFLOP/s: roofline 10 ms; 12 ms
            # is 1.2x (met).
            {"name": "mixed", "mode": "graphs", "decodes": 64, "chunk": 2048, "step_ms": 12.0,
             "replay_ms": 11.0, "graph_steps": 2, "bytes": 15e9, "flops": 8e12,
             "tokens": [2112, 2112], "expected_tokens": 2112},
            # The same steps with the mixed-step graphs set aside: a figure, not a target.
            {"name": "mixed eager", "mode": "eager", "decodes": 64, "chunk": 2048,
             "step_ms": 20.0, "replay_ms": None, "graph_steps": 0, "bytes": 15e9,
             "flops": 8e12, "tokens": [2112, 2112], "expected_tokens": 2112},
        ],
        "offline": {"output_tok_per_s": 4000.0},
    })
    _write(d / "attention.json", {
        "stage": "attention", "dry": False, "complete": True,
        "decode": [{"name": "decode 1x8192", "layers": 32, "gb_per_s": 2100.0,
                    "num_kv_splits": 16}],
        "prefill": [{"tokens": 8192, "paged_tflops": 300.0, "sdpa_best_tflops": 500.0,
                     "sdpa_best_backend": "FLASH_ATTENTION"}],
    })
    if with_peer:
        _write(d / "peer_hf.json", {
            "stage": "peer_hf", "dry": False, "complete": True,
            "batch1": {"tok_per_s": 160.0}, "concurrent": {"output_tok_per_s": 1600.0},
        })
    _write(d / "serve.json", {"stage": "serve", "dry": False, "complete": False,
                              "grpc": {"output_tok_per_s": 3900.0}})
    (d / "stages.tsv").write_text("limits\t0\t12\t40\ndecode\t0\t55\t100\nserve\t124\t80\t80\n")
    (d / "source.txt").write_text("commit=abc123def456\ndirty=0\n")
    return d


def _by_name(summary: dict) -> dict[str, dict]:
    return {e["name"]: e for e in summary["targets"]}


def test_every_target_is_a_ratio_to_this_runs_limit(tmp_path):
    summary = gpu_summary.build_summary([_stages(tmp_path)])
    targets = _by_name(summary)
    assert list(targets) == [
        "decode_batch1", "decode_batch64", "mixed_64_2048", "attention_decode_1x8192",
        "attention_prefill_8192", "vs_hf_batch1", "vs_hf_64_concurrent", "grpc_vs_offline_64",
    ]
    for entry in summary["targets"]:
        assert {"name", "measured", "limit", "ratio", "target", "met"} <= set(entry)

    b1 = targets["decode_batch1"]
    assert b1["limit"] == pytest.approx(5.0)  # 15 GB / 3000 GB/s
    assert b1["ratio"] == pytest.approx(5.0 / 5.5)  # bound / step
    assert b1["met"] is True
    assert b1["limit_spec"] == pytest.approx(15e9 / 3350e9 * 1e3)
    assert b1["ratio_spec"] == pytest.approx(b1["limit_spec"] / 5.5)

    b64 = targets["decode_batch64"]
    assert b64["ratio"] == pytest.approx(1.4)
    assert b64["met"] is False

    mixed = targets["mixed_64_2048"]
    assert mixed["limit"] == pytest.approx(10.0)  # FLOPs-bound: max(5, 10) ms
    assert mixed["ratio"] == pytest.approx(1.2) and mixed["met"] is True
    assert "tokens, not" not in mixed["note"]  # the steps ran the tokens they should
    assert "2 of 2 steps replayed a graph" in mixed["note"]

    attention = targets["attention_decode_1x8192"]
    assert attention["limit"] == BW
    assert attention["ratio"] == pytest.approx(0.7) and attention["met"] is False
    prefill = targets["attention_prefill_8192"]
    assert prefill["ratio"] == pytest.approx(0.6) and prefill["met"] is False

    hf1 = targets["vs_hf_batch1"]
    assert hf1["measured"] == pytest.approx(1e3 / 5.5)  # our tok/s from the b1 step
    assert hf1["ratio"] == pytest.approx(1e3 / 5.5 / 160.0) and hf1["met"] is True
    assert targets["vs_hf_64_concurrent"]["ratio"] == pytest.approx(2.5)
    grpc = targets["grpc_vs_offline_64"]
    assert grpc["ratio"] == pytest.approx(3900 / 4000) and grpc["met"] is True

    figures = {e["name"]: e for e in summary["figures"]}
    assert figures["read_bandwidth"]["ratio"] == pytest.approx(BW / 3350)
    assert figures["bf16_gemm"]["ratio"] == pytest.approx(PEAK / 989)
    assert figures["decode_b1_ctx512_replay"]["ratio"] == pytest.approx(5.2 / 5.0)
    assert figures["decode_b64_ctx512_replay"]["met"] is None
    assert figures["mixed_64_2048_replay"]["ratio"] == pytest.approx(1.1)
    eager = figures["mixed_64_2048_eager"]
    assert eager["ratio"] == pytest.approx(2.0) and eager["target"] is None
    assert summary["device_slug"] == "h100-80gb-hbm3"
    assert summary["source"]["commit"] == "abc123def456"
    assert [t["stage"] for t in summary["stage_times"]] == ["limits", "decode", "serve"]
    assert summary["complete_stages"] == ["attention", "decode", "limits", "peer_hf"]


def test_a_stage_that_did_not_run_is_not_measured(tmp_path):
    work = _stages(tmp_path, with_peer=False)
    (work / "limits.json").unlink()
    decode = json.loads((work / "decode.json").read_text())
    decode["mixed"].append({"name": "mixed 64 decodes + 256 chunk", "decodes": 64,
                            "chunk": 256, "error": "OutOfMemoryError: CUDA out of memory"})
    _write(work / "decode.json", decode)
    summary = gpu_summary.build_summary([work])
    targets = _by_name(summary)
    assert targets["mixed_64_256"]["met"] is None
    assert summary["errors"] == ["decode.mixed[2]: OutOfMemoryError: CUDA out of memory"]
    assert "- decode.mixed[2]: OutOfMemoryError" in gpu_summary.render_table(summary)
    for name in ("vs_hf_batch1", "vs_hf_64_concurrent"):
        assert targets[name]["limit"] is None and targets[name]["met"] is None
    # No limits: no bound, no bandwidth, so no decode or attention ratio either.
    for name in ("decode_batch1", "mixed_64_2048", "attention_decode_1x8192"):
        assert targets[name]["ratio"] is None and targets[name]["met"] is None
    # A comparison that needs no limit still stands.
    assert targets["grpc_vs_offline_64"]["met"] is True


def test_a_later_run_replaces_a_stage_and_says_so(tmp_path):
    first = _stages(tmp_path)
    second = tmp_path / "second"
    second.mkdir()
    _write(second / "peer_hf.json", {"stage": "peer_hf", "complete": True,
                                     "batch1": {"tok_per_s": 200.0},
                                     "concurrent": {"output_tok_per_s": 1000.0}})
    summary = gpu_summary.build_summary([first, second])
    assert _by_name(summary)["vs_hf_64_concurrent"]["ratio"] == pytest.approx(4.0)
    assert summary["runs"] == 2 and summary["stage_origin"]["peer_hf"] == str(second)
    assert "merged from 2 runs" in gpu_summary.render_table(summary)


def test_cli_writes_the_summary_and_the_table(tmp_path, capsys):
    out = tmp_path / "out"
    gpu_summary.main(["--stages", str(_stages(tmp_path)), "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    table = (out / "gpu_table.md").read_text()
    assert capsys.readouterr().out == table
    assert "NVIDIA H100 80GB HBM3" in table and "abc123def4" in table
    rows = [line for line in table.splitlines() if line.startswith("| 8B decode, batch 1")]
    assert rows == ["| 8B decode, batch 1, ctx 512: bound / whole step | 5.50 ms | 5.00 ms | "
                    "0.91x | >= 0.85 | yes | 0.81x |"]
    assert "| **no** |" in table and "not measured" not in table
    # The table again from the committed summary alone.
    again = tmp_path / "again"
    gpu_summary.main(["--summary", str(out / "summary.json"), "--out", str(again), "--quiet"])
    assert (again / "gpu_table.md").read_text().splitlines()[2:] == table.splitlines()[2:]
    assert summary["raw"]["decode"]["offline"]["output_tok_per_s"] == 4000.0


def test_llama3_8b_bytes():
    shape = DecoderShape.from_config(LLAMA_8B)
    assert shape.num_params == 8_030_261_248  # Llama-3-8B's published count
    # Every weight but the (untied) input embedding: 15.0 GB a decode step reads.
    assert shape.weight_bytes_read == (8_030_261_248 - 128256 * 4096) * 2
    assert shape.kv_bytes_per_token == 128 * 1024
    assert causal_pairs(4) == 10 and causal_pairs(2, num_cached=3) == 9
    assert shape.forward_flops(1, 0, 0) == 2 * 32 * shape.layer_linear_params


def test_card_specs_and_slugs():
    assert card_spec("NVIDIA H100 80GB HBM3").read_gb_per_s == 3350
    assert card_spec("NVIDIA H100 PCIe").read_gb_per_s == 2000
    assert card_spec("NVIDIA H200").read_gb_per_s == 4800
    assert card_spec("NVIDIA H200 NVL").bf16_tflops == 835
    assert card_spec("Some Other GPU") is None
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert device_slug("NVIDIA H200") == "h200"


def test_safetensors_writer_and_tokenizer_padding(tmp_path):
    from safetensors import safe_open

    shapes = {"a.weight": (3, 5), "b.norm.weight": (7,)}
    path = tmp_path / "model.safetensors"
    write_safetensors(path, shapes, lambda name, dims: torch.arange(
        torch.Size(dims).numel(), dtype=torch.float32).reshape(dims))
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == sorted(shapes)
        a = f.get_tensor("a.weight")
        assert a.dtype == torch.bfloat16 and a.shape == (3, 5)
        assert torch.equal(a.float().flatten(), torch.arange(15, dtype=torch.float32))
        assert f.get_tensor("b.norm.weight").shape == (7,)

    tok = {"model": {"vocab": {"a": 0, "b": 1, "c": 2}}, "added_tokens": [{"id": 3}]}
    padded = pad_tokenizer(tok, 6)["model"]["vocab"]
    assert padded["<|reserved_4|>"] == 4 and padded["<|reserved_5|>"] == 5 and len(padded) == 5
    with pytest.raises(ValueError, match="at least"):
        pad_tokenizer({"model": {"vocab": {"a": 0, "b": 1}}}, 1)


def test_limits_dry_run_feeds_the_summary(tmp_path):
    from bench import gpu_limits

    gpu_limits.main(["--out", str(tmp_path), "--dry"])
    limits = json.loads((tmp_path / "limits.json").read_text())
    assert limits["complete"] and limits["dry"]
    assert limits["read"]["gb_per_s"] > 0 and limits["gemm"]["tflops"] > 0
    summary = gpu_summary.build_summary([tmp_path])
    assert summary["dry"] is True
    assert "DRY RUN" in gpu_summary.render_table(summary)
