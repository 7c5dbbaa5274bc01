"""`pagedgen-engine` whose engine core dies at its Nth step (a test's fault injection).

    python -m tests.support.crashing_engine --crash-at-step 3 --model DIR --port 0 ...

Everything else is the real server's main(): the point is to watch what the process does when
its engine core dies (health, streams, exit status). The core runs in a process of its own,
started by spawn: the fault is installed there, by the core's entry point below.
"""

import os
import sys

from engine_service.core.engine import LLMEngine
from engine_service.serving import server
from engine_service.serving.core_process import CoreChannel, CoreOptions, run_core

CRASH_AT_ENV = "PAGEDGEN_TEST_CRASH_AT_STEP"


def crashing_core(channel: CoreChannel, options: CoreOptions) -> None:
    crash_at = int(os.environ[CRASH_AT_ENV])
    step = LLMEngine.step

    def crashing_step(self: LLMEngine):
        if self.num_steps + 1 >= crash_at:
            raise RuntimeError(f"injected engine failure at step {self.num_steps + 1}")
        return step(self)

    LLMEngine.step = crashing_step
    run_core(channel, options)


def main() -> None:
    argv = sys.argv[1:]
    at = argv.index("--crash-at-step")
    os.environ[CRASH_AT_ENV] = argv[at + 1]  # the spawned core inherits it
    del argv[at : at + 2]
    server.main(argv, core_target=crashing_core)


if __name__ == "__main__":
    main()
