"""pagedgen-certs: a development CA and a certificate per service, for mutual TLS.

    pagedgen-certs --out certs --engine e0 --engine e1 --router --index --client

writes, under --out (kept when present and still fitting, so running it again is harmless):

    ca.pem, ca-key.pem                  the CA every service trusts (--tls-ca ca.pem)
    engine-<id>.pem, engine-<id>-key.pem  an engine allowed to register engine id <id>
    engine.pem, engine-key.pem          an engine certificate naming no id (--engine '')
    router.pem, router-key.pem          a router (reads the index; its replicas trust it)
    index.pem, index-key.pem            the prefix index
    client.pem, client-key.pem          an end client (a tool, grpcurl -cert/-key)

Keys are mode 0600. Each certificate names its role in a URI (spiffe://pagedgen/<role>[/<id>])
and in a DNS name (<role>.pagedgen.internal) and serves the hosts given (--host, repeatable;
default localhost, 127.0.0.1, ::1). For production, use your own CA with the same names.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trust.certs import DEFAULT_HOSTS, ensure_ca, ensure_leaf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedgen-certs", description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write into (made if absent)")
    p.add_argument("--engine", action="append", default=[], metavar="ID",
                   help="an engine certificate for engine id ID (repeatable; '' names no id)")
    p.add_argument("--router", action="store_true", help="a router certificate")
    p.add_argument("--index", action="store_true", help="a prefix index certificate")
    p.add_argument("--client", action="store_true", help="an end client's certificate")
    p.add_argument("--host", action="append", default=None, metavar="NAME_OR_IP",
                   help=f"a host the certificates serve (default: {', '.join(DEFAULT_HOSTS)})")
    args = p.parse_args(argv)
    for engine_id in args.engine:
        if "/" in engine_id:
            p.error(f"--engine: {engine_id!r} holds '/'; an engine id names one engine")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    hosts = tuple(args.host) if args.host else DEFAULT_HOSTS
    issued = [ensure_ca(out)]
    wanted = [("engine", e or None) for e in args.engine]
    wanted += [(role, None) for role in ("router", "index", "client") if getattr(args, role)]
    issued += [ensure_leaf(out, role, engine_id, hosts) for role, engine_id in wanted]
    for item in issued:
        print(f"{'wrote' if item.written else 'kept '} {item.cert} {item.key}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
