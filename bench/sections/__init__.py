"""The sections of pagedgen-bench, in the order they run and appear in the report.

Each is one module with:
  PARTS   the names --skip (and, for a standalone section, --only) take;
  KEY     its key in bench.json where it stands alone (None: it writes several keys);
  run(ctx: RunContext) -> dict
          the one entry point: the section's figures, keyed as in bench.json;
  report(results, rel) -> list[str]
          its fragment of README_results.md (nothing when its figures are absent);
  target_rows(results) -> list[str]
          (some) its rows of the issue #6 targets table.
The measuring itself lives in the modules beside this package (bench/router.py, ...)."""

from bench.sections import (
    beam,
    block_sizes,
    index,
    memory,
    parallel_sampling,
    peers,
    pin_budget,
    pinning,
    preemption,
    prefix,
    router,
)

SECTIONS = (peers, memory, prefix, index, pinning, pin_budget, beam, parallel_sampling,
            preemption, block_sizes, router)
PART_NAMES = tuple(part for section in SECTIONS for part in section.PARTS)
# Sections that stand alone (no ratio or roofline depends on them): `--only` re-takes them and
# merges them into an existing bench.json, each with its own machine, load and commit.
STANDALONE = {section.PARTS[0]: section for section in SECTIONS if section.KEY is not None}
