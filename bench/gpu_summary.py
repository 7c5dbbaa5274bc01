"""The GPU check's summary: one entry per target, each a ratio to a limit from the same run,
and the README's GPU table made from it.

    python -m bench.gpu_summary --stages DIR --out DIR     # stage JSONs -> summary.json + table
    python -m bench.gpu_summary --summary FILE --out DIR   # the table again from a summary
    python -m bench.gpu_summary --stages RUN1 --stages RUN2 --out DIR   # a stage rerun later

With several --stages folders a stage's file from a later one replaces an earlier one's (a
stage run again on a second lease); the summary then says which run each stage came from,
and the ratios that mix runs are no longer from one run.

Reads what bench/gpu_check.sh's stages wrote (limits.json, decode.json, attention.json,
peer_hf.json, serve.json, stages.tsv, source.txt); a stage that is missing or stopped early
leaves its entries with `measured` or `limit` null and `met` null (not measured), never a
guess. Every entry has `name`, `measured`, `limit`, `ratio`, `target`, `met`, plus its unit,
what the ratio divides, and, where the limit is a property of the card, the same ratio
against the vendor's spec (`limit_spec`, `ratio_spec`).

No torch here: the check runs this after every stage, so a run cut short still leaves its
summary.
"""

from __future__ import annotations

import argparse
import json
import operator
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STAGE_FILES = ("limits", "decode", "attention", "peer_hf", "serve")
SUMMARY_FILE = "summary.json"
TABLE_FILE = "gpu_table.md"
_OPS = {">=": operator.ge, "<=": operator.le}


@dataclass(slots=True)
class Entry:
    name: str
    label: str
    unit: str
    measured: float | None
    limit: float | None
    ratio_is: str  # "measured / limit" or "limit / measured"
    target: str | None  # ">= 0.85", "<= 1.3"; None for a figure without a target
    ratio: float | None = None
    met: bool | None = None
    limit_spec: float | None = None
    ratio_spec: float | None = None
    note: str = ""

    def __post_init__(self) -> None:
        self.ratio = _ratio(self.measured, self.limit, self.ratio_is)
        self.ratio_spec = _ratio(self.measured, self.limit_spec, self.ratio_is)
        if self.target is not None and self.ratio is not None:
            op, value = self.target.split()
            self.met = bool(_OPS[op](self.ratio, float(value)))


def _ratio(measured: float | None, limit: float | None, ratio_is: str) -> float | None:
    if measured is None or limit is None or measured <= 0 or limit <= 0:
        return None
    return measured / limit if ratio_is == "measured / limit" else limit / measured


def _get(data: dict | None, *keys):
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _bound_ms(nbytes: float | None, gb_per_s: float | None) -> float | None:
    """Milliseconds to move `nbytes` at `gb_per_s` (1e9 bytes a second)."""
    if nbytes is None or not gb_per_s:
        return None
    return nbytes / gb_per_s / 1e6


def _roofline_ms(nbytes, flops, gb_per_s, tflops) -> float | None:
    memory = _bound_ms(nbytes, gb_per_s)
    compute = flops / tflops / 1e9 if flops is not None and tflops else None
    if memory is None or compute is None:
        return None
    return max(memory, compute)


def _tok_per_s(step_ms: float | None) -> float | None:
    return 1e3 / step_ms if step_ms else None


def build_entries(stages: dict[str, dict]) -> tuple[list[Entry], list[Entry]]:
    """(targets, other figures) from the stages' JSON."""
    limits = stages.get("limits")
    bw = _get(limits, "read", "gb_per_s")
    peak = _get(limits, "gemm", "tflops")
    spec_bw = _get(limits, "spec", "read_gb_per_s")
    spec_peak = _get(limits, "spec", "bf16_tflops")
    decode = stages.get("decode") or {}
    rows = decode.get("decode") or []
    by_role = {row.get("role"): row for row in rows if row.get("role")}
    targets: list[Entry] = []
    figures: list[Entry] = [
        Entry("read_bandwidth", "read bandwidth (sum over 4 GiB, best of 10) vs spec", "GB/s",
              bw, spec_bw, "measured / limit", None),
        Entry("bf16_gemm", "bf16 GEMM 8192^3, best of 10, vs spec", "TFLOP/s", peak,
              spec_peak, "measured / limit", None),
        Entry("copy_bandwidth", "device copy (read + written) vs spec", "GB/s",
              _get(limits, "copy", "gb_per_s"), spec_bw, "measured / limit", None),
    ]

    def decode_entry(row: dict | None, name: str, label: str, ratio_is: str,
                     target: str | None, time_key: str = "step_ms") -> Entry:
        row = row or {}
        return Entry(name, label, "ms", row.get(time_key), _bound_ms(row.get("bytes"), bw),
                     ratio_is, target, limit_spec=_bound_ms(row.get("bytes"), spec_bw),
                     note=f"{row.get('name', 'not measured')}; bound = (weights + KV bytes) "
                          f"/ measured read bandwidth")

    b1, b64 = by_role.get("batch1"), by_role.get("batch64")
    targets.append(decode_entry(b1, "decode_batch1", "8B decode, batch 1, ctx 512: bound / "
                                "whole step", "limit / measured", ">= 0.85"))
    targets.append(decode_entry(b64, "decode_batch64", "8B decode, batch 64, ctx 512: whole "
                                "step / bound", "measured / limit", "<= 1.3"))
    for row in rows:
        figures.append(decode_entry(row, f"{_slug(row['name'])}_step",
                                    f"{row['name']}: whole step / bound", "measured / limit",
                                    None))
        figures.append(decode_entry(row, f"{_slug(row['name'])}_replay",
                                    f"{row['name']}: graph replay / bound", "measured / limit",
                                    None, time_key="replay_ms"))

    for row in decode.get("mixed") or []:
        # Rows from before the mixed-step graphs have no mode: they ran as the engine chose.
        eager = row.get("mode") == "eager"
        exact = all(t == row.get("expected_tokens") for t in row.get("tokens", []))
        name = f"mixed_{row['decodes']}_{row['chunk']}" + ("_eager" if eager else "")
        what = f"mixed step, {row['decodes']} decodes + a {row['chunk']}-token chunk"
        roofline = _roofline_ms(row.get("bytes"), row.get("flops"), bw, peak)
        roofline_spec = _roofline_ms(row.get("bytes"), row.get("flops"), spec_bw, spec_peak)
        note = ("roofline = max(bytes / bandwidth, FLOPs / GEMM peak), both measured"
                + ("" if exact else f"; the steps ran {row.get('tokens')} tokens, not "
                                    f"{row.get('expected_tokens')}")
                + (f"; {row.get('graph_steps')} of {len(row.get('tokens') or [])} steps "
                   "replayed a graph" if "graph_steps" in row else ""))
        # The target is on the engine as it serves (graphs); eager is the figure beside it.
        (figures if eager else targets).append(Entry(
            name, f"{what}{' (eager)' if eager else ''}: step / roofline", "ms",
            row.get("step_ms"), roofline, "measured / limit", None if eager else "<= 1.3",
            limit_spec=roofline_spec, note=note))
        if not eager and row.get("replay_ms") is not None:
            figures.append(Entry(f"{name}_replay", f"{what}: graph replay / roofline", "ms",
                                 row.get("replay_ms"), roofline, "measured / limit", None,
                                 limit_spec=roofline_spec, note="CUDA events around replay"))

    attention = stages.get("attention") or {}
    for row in attention.get("decode") or []:
        targets.append(Entry(
            f"attention_{_slug(row['name'])}",
            f"decode attention {row['name'].removeprefix('decode ')} ({row.get('layers')} "
            f"layers, one graph) vs read bandwidth", "GB/s", row.get("gb_per_s"), bw,
            "measured / limit", ">= 0.8", limit_spec=spec_bw,
            note=f"split-KV {row.get('num_kv_splits')}"))
    for row in attention.get("prefill") or []:
        ours, sdpa = row.get("paged_tflops"), row.get("sdpa_best_tflops")
        targets.append(Entry(
            f"attention_prefill_{row['tokens']}",
            f"prefill attention, {row['tokens']} tokens causal vs SDPA is_causal "
            f"({row.get('sdpa_best_backend')})", "TFLOP/s", ours, sdpa, "measured / limit",
            ">= 0.8",
            note=f"vs the spec's bf16 peak: ours {_fmt_ratio(_of_peak(ours, spec_peak))}, "
                 f"SDPA {_fmt_ratio(_of_peak(sdpa, spec_peak))}"))

    peer = stages.get("peer_hf") or {}
    offline = _get(decode, "offline", "output_tok_per_s")
    targets.append(Entry(
        "vs_hf_batch1", "batch-1 decode vs HF static cache + torch.compile", "tok/s",
        _tok_per_s((b1 or {}).get("step_ms")), _get(peer, "batch1", "tok_per_s"),
        "measured / limit", ">= 1.0",
        note="ours: whole step at ctx 512; HF: (t(256) - t(32)) / 224 tokens, 512-token prompt"))
    targets.append(Entry(
        "vs_hf_64_concurrent", "64 concurrent requests, output throughput vs HF static + "
        "compile", "tok/s", offline, _get(peer, "concurrent", "output_tok_per_s"),
        "measured / limit", ">= 2.0", note="fixed workload: 64 x (128-1,024 in, 256 out)"))
    targets.append(Entry(
        "grpc_vs_offline_64", "64 gRPC streams vs the offline API, output throughput", "tok/s",
        _get(stages.get("serve"), "grpc", "output_tok_per_s"), offline, "measured / limit",
        ">= 0.95", note="same workload and engine settings"))
    return targets, figures


def _of_peak(tflops: float | None, peak: float | None) -> float | None:
    return _ratio(tflops, peak, "measured / limit")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _read_stages(stage_dirs: list[Path]) -> tuple[dict[str, dict], dict[str, str]]:
    """Each stage's JSON, the last folder's where several have it, and which folder."""
    stages, origin = {}, {}
    for stage_dir in stage_dirs:
        for name in STAGE_FILES:
            path = stage_dir / f"{name}.json"
            if path.is_file():
                try:
                    stages[name] = json.loads(path.read_text())
                except json.JSONDecodeError as error:
                    stages[name] = {"stage": name, "unreadable": str(error)}
                origin[name] = str(stage_dir)
    return stages, origin


def _read_timings(stage_dir: Path) -> list[dict]:
    path = stage_dir / "stages.tsv"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 4:
            name, rc, seconds, limit = parts
            rows.append({"stage": name, "exit": int(rc), "seconds": int(seconds),
                         "limit_s": int(limit)})
    return rows


def _read_source(stage_dir: Path) -> dict:
    path = stage_dir / "source.txt"
    if not path.is_file():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def _errors(value, where: str) -> list[str]:
    """Every measurement that stopped with an error, as 'stage.path: error'."""
    if isinstance(value, dict):
        found = [f"{where}: {value['error']}"] if isinstance(value.get("error"), str) else []
        for key, item in value.items():
            found += _errors(item, f"{where}.{key}")
        return found
    if isinstance(value, list):
        return [e for i, item in enumerate(value) for e in _errors(item, f"{where}[{i}]")]
    return []


def build_summary(stage_dirs: list[Path]) -> dict:
    stages, origin = _read_stages(stage_dirs)
    targets, figures = build_entries(stages)
    limits = stages.get("limits") or {}
    return {
        "device": _get(limits, "device", "name"),
        "device_slug": limits.get("device_slug"),
        "spec": limits.get("spec"),
        "software": {k: v for k, v in (limits.get("device") or {}).items()
                     if k in ("python", "torch", "triton", "transformers", "grpcio")},
        "source": next((s for d in reversed(stage_dirs) if (s := _read_source(d))), {}),
        "runs": len(stage_dirs),
        "stage_origin": origin if len(stage_dirs) > 1 else None,
        "dry": any(s.get("dry") for s in stages.values()),
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        "stage_times": [t for d in stage_dirs for t in _read_timings(d)],
        "complete_stages": sorted(n for n, s in stages.items() if s.get("complete")),
        "errors": [e for name, stage in stages.items() for e in _errors(stage, name)],
        "targets": [asdict(e) for e in targets],
        "figures": [asdict(e) for e in figures],
        "raw": stages,
    }


def _num(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    digits = 2 if value < 100 else 0
    return f"{value:,.{digits}f} {unit}"


def render_table(summary: dict) -> str:
    """Markdown: the run's header, the targets, the other figures, the stages' times."""
    spec = summary.get("spec") or {}
    source = summary.get("source") or {}
    lines = [f"GPU check on {summary.get('device') or 'an unknown device'}"
             + (f" (spec {spec.get('name')}: {spec.get('read_gb_per_s')} GB/s, "
                f"{spec.get('bf16_tflops')} bf16 TFLOP/s)" if spec else "")
             + (f" at {source.get('commit', '')[:10]}" if source.get("commit") else "")
             + (" (working tree had changes)" if source.get("dirty") not in (None, "0") else "")
             + f", {summary.get('written')}"
             + (f"; stages merged from {summary['runs']} runs" if summary.get("runs", 1) > 1
                else "")
             + (" — DRY RUN on a CPU, no figure means anything" if summary.get("dry") else "")
             + ".", ""]
    # "at spec": the same ratio with the vendor's figure in place of the measured limit,
    # where the limit is a property of the card.
    lines += ["| target | measured | limit | ratio | wanted | met | at spec |",
              "| --- | ---: | ---: | ---: | :---: | :---: | ---: |"]
    for e in summary["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[e["met"]]
        lines.append(f"| {e['label']} | {_num(e['measured'], e['unit'])} | "
                     f"{_num(e['limit'], e['unit'])} | {_fmt_ratio(e['ratio'])} | "
                     f"{e['target']} | {met} | {_fmt_ratio(e['ratio_spec'])} |")
    lines += ["", "| figure | measured | limit | ratio | vs spec |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for e in summary["figures"]:
        lines.append(f"| {e['label']} | {_num(e['measured'], e['unit'])} | "
                     f"{_num(e['limit'], e['unit'])} | {_fmt_ratio(e['ratio'])} | "
                     f"{_fmt_ratio(e['ratio_spec'])} |")
    if summary.get("errors"):
        lines += ["", "Measurements that stopped with an error:"]
        lines += [f"- {error}" for error in summary["errors"]]
    if summary.get("stage_times"):
        lines += ["", "| stage | exit | seconds | limit |", "| --- | ---: | ---: | ---: |"]
        for t in summary["stage_times"]:
            lines.append(f"| {t['stage']} | {t['exit']} | {t['seconds']} | {t['limit_s']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_summary",
                                description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--stages", type=Path, action="append",
                        help="the directory the stages wrote into (again: a later run's)")
    source.add_argument("--summary", type=Path, help="a summary.json to render again")
    p.add_argument("--out", type=Path, required=True,
                   help=f"directory for {SUMMARY_FILE} (with --stages) and {TABLE_FILE}")
    p.add_argument("--quiet", action="store_true", help="print nothing")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stages is not None:
        summary = build_summary(args.stages)
        tmp = args.out / (SUMMARY_FILE + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(args.out / SUMMARY_FILE)
    else:
        summary = json.loads(args.summary.read_text())
    table = render_table(summary)
    (args.out / TABLE_FILE).write_text(table)
    if not args.quiet:
        print(table, end="")


if __name__ == "__main__":
    main()
