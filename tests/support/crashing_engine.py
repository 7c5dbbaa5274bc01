"""`pagedgen-engine` whose engine thread dies at its Nth step (a test's fault injection).

    python -m tests.support.crashing_engine --crash-at-step 3 --model DIR --port 0 ...

Everything else is the real server's main(): the point is to watch what the process does when
its engine thread dies (health, streams, exit status).
"""

import sys

from engine_service.core.engine import LLMEngine
from engine_service.serving import server


def main() -> None:
    argv = sys.argv[1:]
    at = argv.index("--crash-at-step")
    crash_at = int(argv[at + 1])
    del argv[at : at + 2]
    step = LLMEngine.step

    def crashing_step(self: LLMEngine):
        if self.num_steps + 1 >= crash_at:
            raise RuntimeError(f"injected engine failure at step {self.num_steps + 1}")
        return step(self)

    LLMEngine.step = crashing_step
    server.main(argv)


if __name__ == "__main__":
    main()
