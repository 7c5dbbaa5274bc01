"""Exit 0 when a gRPC server reports SERVING, 1 otherwise (compose healthchecks, scripts).

    python -m prefix_index.tools.healthcheck 127.0.0.1:50061 [--service NAME] [--timeout-s 2]
"""

from __future__ import annotations

import argparse
import sys

from prefix_index.tools.launch import wait_serving


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefix_index.tools.healthcheck",
                                description=__doc__.split("\n")[0])
    p.add_argument("target", help="host:port")
    p.add_argument("--service", default="", help="health service name ('' = the whole server)")
    p.add_argument("--timeout-s", type=float, default=2.0)
    args = p.parse_args(argv)
    try:
        wait_serving(args.target, args.timeout_s, args.service)
    except TimeoutError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
