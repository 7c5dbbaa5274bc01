"""How long a constrained request waits behind a slow compilation that was cancelled: the
serving core's compile queue with the compiler in a process of its own (the compilation is
stopped, the process started again) against the same queue compiling on a thread of the core
(as it did before: the cancelled compilation runs to its end first).

Each trial, on SmolLM2's tokenizer: a request whose schema takes seconds to compile is queued,
aborted 0.5 s later, and a request with a small schema is queued at once; timed from its queuing
to its grammar being ready. Both compilers are warm (tokenizer loaded, worker started) and no
schema is compiled twice (a new salt each trial: neither cache has it).

    python -m bench.grammar_cancel [--trials 2] [--out bench/results/grammar_cancel.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

ABORT_AFTER_S = 0.5


def slow_schema(salt: str, fields: int = 40) -> dict:
    properties = {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{1,{40 + i}}}-{salt}"}
                  for i in range(fields)}
    return {"type": "object", "properties": properties, "required": list(properties)}


def small_schema(salt: str) -> dict:
    return {"type": "object", "properties": {"id": {"type": "integer"}, salt: {"type": "string"}},
            "required": ["id"]}


def command(request_id: str, schema: dict) -> tuple:
    from engine_service import SamplingParams

    params = SamplingParams(max_tokens=8, structured_outputs={"json": schema})
    return ("add", request_id, [1, 2, 3], params, None, 0, False)


def waited_behind_a_cancel(compile_grammar, interrupt, salt: str) -> float:
    """Seconds the small schema's request waited, queued just after the slow one's abort."""
    from engine_service.serving.grammar_queue import GrammarQueue

    ready = threading.Event()
    queue = GrammarQueue(compile_grammar, ready.set, interrupt)
    try:
        slow = command(f"slow-{salt}", slow_schema(salt))
        queue.submit(slow[1], slow, slow[3])
        time.sleep(ABORT_AFTER_S)
        queue.abort(slow[1])
        small = command(f"small-{salt}", small_schema(salt))
        started = time.perf_counter()
        queue.submit(small[1], small, small[3])
        while True:
            ready.wait()
            ready.clear()
            done = queue.ready()
            if done:
                assert [item.command[1] for item in done] == [small[1]], done
                done[0].future.result()  # compiled, not failed
                return time.perf_counter() - started
    finally:
        queue.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results/grammar_cancel.json"))
    args = p.parse_args(argv)
    from engine_service.model.config import load_model_config
    from engine_service.model.grammar import GrammarCompiler
    from engine_service.model.structured_outputs import StructuredOutputsParams
    from engine_service.serving.grammar_process import GrammarProcess
    from engine_service.tools.prepare_model import ensure_default_model

    model_config = load_model_config(str(ensure_default_model()))
    eos = [2]
    thread = GrammarCompiler(model_config, model_config.vocab_size, eos)
    process = GrammarProcess(model_config, model_config.vocab_size, eos)
    for compiler in (thread, process):  # warm: tokenizer loaded, worker started
        compiler.compile(StructuredOutputsParams(json_object=True))
    started = time.perf_counter()
    thread.compile(StructuredOutputsParams(json=slow_schema("alone")))
    slow_compile_s = time.perf_counter() - started
    waits: dict[str, list[float]] = {"thread": [], "process": []}
    for trial in range(args.trials):  # alternated, each on schemas of its own
        waits["thread"].append(waited_behind_a_cancel(thread.compile, None, f"t{trial}"))
        waits["process"].append(waited_behind_a_cancel(
            process.compile, process.interrupt, f"p{trial}"))
    process.close()
    result = {
        "tokenizer": "SmolLM2-135M-Instruct",
        "slow_schema_compile_s": round(slow_compile_s, 2),
        "abort_after_s": ABORT_AFTER_S,
        "waited_s": {name: [round(w, 2) for w in values] for name, values in waits.items()},
        "process_workers_started": process.num_started,
        "ratio_thread_to_process_median": round(
            statistics.median(waits["thread"]) / statistics.median(waits["process"]), 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
