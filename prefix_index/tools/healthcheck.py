"""Exit 0 when a gRPC server reports SERVING, 1 otherwise (compose healthchecks, scripts).

    python -m prefix_index.tools.healthcheck 127.0.0.1:50061 [--service NAME] [--timeout-s 2] \
        --tls-cert certs/router.pem --tls-key certs/router-key.pem --tls-ca certs/ca.pem

Over mutual TLS (any role's certificate will do: health needs no role), or --insecure for a
plain-text server.
"""

from __future__ import annotations

import argparse
import sys

from prefix_index.tools.launch import wait_serving
from trust.cli_args import add_tls_args, resolve_tls_args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefix_index.tools.healthcheck",
                                description=__doc__.split("\n")[0])
    p.add_argument("target", help="host:port")
    p.add_argument("--service", default="", help="health service name ('' = the whole server)")
    p.add_argument("--timeout-s", type=float, default=2.0)
    add_tls_args(p)
    args = p.parse_args(argv)
    resolve_tls_args(p, args)
    try:
        wait_serving(args.target, args.timeout_s, args.service,
                     tls=args.tls.files if args.tls else None)
    except TimeoutError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
