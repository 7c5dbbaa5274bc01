"""What engine steps execute, counted exactly rather than timed (issue 36).

Host work that does not grow with the output shows as the same counts early and late in a
request, however the machine's load moves the timings. Two counts over the same steps:

- calls of each function, Python and C (cProfile's counts);
- bytecode instructions run in each Python function (a trace of opcodes): a loop in Python runs
  instructions whether or not it calls anything.

One C call that copies a whole list counts once at any length; those are caught where they
happen (tests/engine/test_step_host_work.py counts the sequences' copying properties).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
from dataclasses import dataclass


@dataclass
class StepWork:
    calls: dict[str, int]  # "file:line:function" -> calls
    instructions: dict[str, int]  # "file:line:function" -> bytecode instructions run

    def total_calls(self) -> int:
        return sum(self.calls.values())

    def total_instructions(self) -> int:
        return sum(self.instructions.values())


def count_step_work(engine, steps: int) -> StepWork:
    """Steps `engine` `steps` times on this thread, counting what the steps execute."""
    instructions: dict[str, int] = {}

    def count_opcode(frame, event, _arg):
        if event == "opcode":
            code = frame.f_code
            key = f"{code.co_filename}:{code.co_firstlineno}:{code.co_qualname}"
            instructions[key] = instructions.get(key, 0) + 1
        return count_opcode

    def trace(frame, _event, _arg):
        frame.f_trace_opcodes = True
        return count_opcode

    profile = cProfile.Profile()
    previous = sys.gettrace()  # a debugger's or coverage's tracer: back when done
    sys.settrace(trace)
    profile.enable()
    try:
        for _ in range(steps):
            engine.step()
    finally:
        profile.disable()
        sys.settrace(previous)
    calls = {f"{file}:{line}:{name}": counts[1]
             for (file, line, name), counts in pstats.Stats(profile).stats.items()}  # type: ignore[attr-defined]
    return StepWork(calls, instructions)


def differences(early: dict[str, int], late: dict[str, int],
                allowed: int = 0) -> dict[str, tuple[int, int]]:
    """The functions whose counts moved by more than `allowed`, early -> late."""
    return {fn: (early.get(fn, 0), late.get(fn, 0)) for fn in sorted(set(early) | set(late))
            if abs(late.get(fn, 0) - early.get(fn, 0)) > allowed}
