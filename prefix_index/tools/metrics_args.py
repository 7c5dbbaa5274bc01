"""The Prometheus port's flags, the same for every server: the metrics carry no key (a
scraper sends none), so they bind where the server binds unless told otherwise, never wider
by default."""

from __future__ import annotations

import argparse


def add_metrics_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0 = off)")
    p.add_argument("--metrics-host", default=None,
                   help="address the Prometheus port binds (default: --host's); its counters "
                        "are served to anyone who reaches it, with no key")


def resolve_metrics_host(args: argparse.Namespace) -> None:
    """--metrics-host defaults to --host (a server bound to loopback keeps its counters there);
    an IPv6 address without the brackets --host may carry (Prometheus' server takes none)."""
    if args.metrics_host is None:
        args.metrics_host = args.host
    if args.metrics_host.startswith("[") and args.metrics_host.endswith("]"):
        args.metrics_host = args.metrics_host[1:-1]
