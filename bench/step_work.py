"""What engine steps execute, counted rather than timed (issue 36).

Host work that does not grow with the output shows as the same counts early and late in a
request, however the machine's load moves the timings. Two counts over the same steps, on the
calling thread (the engine steps there; other threads are not counted):

- calls of each function, Python and C (cProfile's counts);
- bytecode instructions run in each Python function (a trace of opcodes): a loop in Python runs
  instructions whether or not it calls anything.

What neither sees: one C call whose own work grows (a list copied, sliced, summed or turned
into a tensor counts once at any length). The tests that count those are specific: the
sequences' copying properties and the detokenizer's whole text
(tests/engine/test_step_host_work.py) and the detokenizer's decode window
(tests/engine/test_detokenizer.py).

The garbage collector is run before the steps and kept off during them: finalizers of objects
that other code left behind would otherwise be counted as the steps' work.
"""

from __future__ import annotations

import cProfile
import gc
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
    """Steps `engine` `steps` times on this thread, counting what the steps execute. Refuses
    while another profiler is active (cProfile takes the one profiling hook); a tracer that
    was set (a debugger's, coverage's) is put back after."""
    if sys.getprofile() is not None:
        raise RuntimeError("another profiler is active: count_step_work needs the profiling hook")
    instructions: dict[str, int] = {}
    counting = True  # frames made in the window keep this tracer: they stop counting after it

    def count_opcode(frame, event, _arg):
        if event == "opcode" and counting:
            code = frame.f_code
            key = f"{code.co_filename}:{code.co_firstlineno}:{code.co_qualname}"
            instructions[key] = instructions.get(key, 0) + 1
        return count_opcode

    def trace(frame, _event, _arg):
        frame.f_trace_opcodes = True
        return count_opcode

    profile = cProfile.Profile()
    previous = sys.gettrace()
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        sys.settrace(trace)
        profile.enable()
        for _ in range(steps):
            engine.step()
    finally:
        profile.disable()
        sys.settrace(previous)
        counting = False
        if collecting:
            gc.enable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    calls = {f"{file}:{line}:{name}": counts[1] for (file, line, name), counts in stats.items()}
    return StepWork(calls, instructions)


def differences(early: dict[str, int], late: dict[str, int],
                allowed: int = 0) -> dict[str, tuple[int, int]]:
    """The functions whose counts moved by more than `allowed`, early -> late."""
    return {fn: (early.get(fn, 0), late.get(fn, 0)) for fn in sorted(set(early) | set(late))
            if abs(late.get(fn, 0) - early.get(fn, 0)) > allowed}
