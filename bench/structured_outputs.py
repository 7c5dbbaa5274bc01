"""Structured outputs on SmolLM2 (the offline API): how many of 16 chat replies that are asked
for a JSON record match its schema with and without the constraint, and what the constraint
costs a generated token.

Validity: the batch once unconstrained and once constrained (greedy, max_tokens 96). An
unconstrained reply counts as valid when its text, or its first {...} span (a model may wrap
the JSON in prose or a code fence), parses and matches the schema.

Cost: each round runs the constrained batch and then the same prompts unconstrained with each
request's max_tokens set to the length of its constrained reply (ignore_eos): the same prefills
and the same output tokens, so the time ratio is what the masks cost (their fill on the host,
their application to the logits). Alternated rounds, best of each; the tokenizer load and the
grammar's first compilation are timed apart, before them.

    python -m bench.structured_outputs [--rounds 2] [--out bench/results/structured_outputs.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import jsonschema

SCHEMA = {
    "type": "object",
    "required": ["name", "legs", "habitat"],
    "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "legs": {"type": "integer"},
                   "habitat": {"type": "string"}},
}
ANIMALS = ["cat", "dog", "spider", "snake", "horse", "ant", "owl", "octopus", "frog", "bee",
           "whale", "crab", "eagle", "goat", "shark", "beetle"]
MAX_TOKENS = 96


@dataclass(slots=True)
class Run:
    constrained: bool
    valid: int  # replies that match the schema
    stopped: int  # replies that ended before max_tokens
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Describe a {animal} as a JSON object with the "
              f"fields name, legs and habitat."}] for animal in ANIMALS]


def is_valid(text: str) -> bool:
    for candidate in (text, text[text.find("{"): text.rfind("}") + 1]):
        try:
            jsonschema.validate(json.loads(candidate), SCHEMA)
            return True
        except (ValueError, jsonschema.ValidationError):
            continue
    return False


def run_once(llm, constrained: bool, lengths: list[int] | None = None) -> tuple[Run, list[int]]:
    """The batch, and each reply's length. lengths: unconstrained replies of exactly these."""
    from engine_service import SamplingParams

    if lengths is None:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                structured_outputs={"json": SCHEMA} if constrained else None)
    else:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outputs = llm.chat(prompts(), params)
    seconds = time.perf_counter() - start
    completions = [o.outputs[0] for o in outputs]
    run = Run(constrained, sum(is_valid(c.text) for c in completions),
              sum(c.finish_reason == "stop" for c in completions),
              sum(len(c.token_ids) for c in completions), seconds)
    return run, [len(c.token_ids) for c in completions]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results/structured_outputs.json"))
    args = p.parse_args(argv)
    from engine_service import LLM, SamplingParams

    llm = LLM(max_model_len=1024, num_blocks=512)
    started = time.perf_counter()
    llm.llm_engine.grammars.compile(
        SamplingParams(structured_outputs={"json": SCHEMA}).structured_outputs)
    first_compile_s = time.perf_counter() - started  # the tokenizer load included
    free, _ = run_once(llm, False)
    constrained, lengths = run_once(llm, True)
    rounds = []
    for _ in range(args.rounds):
        rounds.append([run_once(llm, True)[0], run_once(llm, False, lengths)[0]])
    best = [min((r[i] for r in rounds), key=lambda run: run.seconds) for i in (0, 1)]
    result = {
        "model": "SmolLM2-135M-Instruct", "dtype": llm.llm_engine.config.dtype,
        "requests": len(ANIMALS), "max_tokens": MAX_TOKENS,
        "first_compile_s": round(first_compile_s, 3),
        "valid": {"unconstrained": free.valid, "constrained": constrained.valid},
        "stopped": {"unconstrained": free.stopped, "constrained": constrained.stopped},
        "rounds (constrained, same lengths unconstrained)": [
            [{**asdict(run), "tokens_per_s": round(run.tokens_per_s, 1)} for run in r]
            for r in rounds],
        "time_ratio_constrained_to_same_lengths": round(best[0].seconds / best[1].seconds, 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
