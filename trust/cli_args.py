"""The TLS flags every console script takes: --tls-cert, --tls-key, --tls-ca (or the variables
PAGEDGEN_TLS_CERT / _KEY / _CA) and --insecure.

Secure is the default: a service given no TLS files refuses to start (exit 2, the message
says how to get them); plain text only behind an explicit --insecure, which logs a warning.
pagedgen-stack makes certificates and runs everything with mutual TLS.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from trust.credentials import TlsFiles, TlsMaterial

log = logging.getLogger("trust")
TLS_ENV = {"cert": "PAGEDGEN_TLS_CERT", "key": "PAGEDGEN_TLS_KEY", "ca": "PAGEDGEN_TLS_CA"}
PLAIN_TEXT_WARNING = ("%s runs in PLAIN TEXT (--insecure): anyone on the network can read and "
                      "forge its calls; give --tls-cert, --tls-key and --tls-ca (pagedgen-certs "
                      "makes them)")
NO_TLS_FILES = ("no TLS files: give --tls-cert, --tls-key and --tls-ca (or set "
                f"${TLS_ENV['cert']}, ${TLS_ENV['key']} and ${TLS_ENV['ca']}); "
                "`pagedgen-certs --out certs --engine '' --router --index --client` makes a "
                "development CA and certificates. Plain text only with --insecure")


def add_tls_args(p: argparse.ArgumentParser, server_only_option: bool = False) -> None:
    """server_only_option: the engine's --tls-server-only (its port takes routers and the
    index with their certificates, or end clients without)."""
    g = p.add_argument_group("TLS (pagedgen-certs makes a development CA and certificates)")
    g.add_argument("--tls-cert", default=None,
                   help="this process's certificate, PEM; served to clients and presented to "
                        f"the services it calls (default: ${TLS_ENV['cert']})")
    g.add_argument("--tls-key", default=None,
                   help=f"its private key, PEM (default: ${TLS_ENV['key']})")
    g.add_argument("--tls-ca", default=None,
                   help="the CA that signs every service's certificate, PEM: peers are "
                        f"verified against it (default: ${TLS_ENV['ca']})")
    g.add_argument("--insecure", action="store_true",
                   help="plain text, no TLS (logs a warning); without it a service given no "
                        "TLS files refuses to start. Refused with TLS files")
    if server_only_option:
        g.add_argument("--tls-server-only", action="store_true",
                       help="TLS that asks clients for no certificate: an engine served alone "
                            "to end clients (who bring API keys). grpcio cannot ask for a "
                            "certificate without requiring it, so a router is then not known "
                            "as one (its tenant header is not believed). Default: mutual TLS")


def resolve_tls_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sets args.tls: TlsMaterial (the three files read), or None for plain text (--insecure
    only). p.error (exit 2) when no files are given without --insecure, and names the flag when
    the files are incomplete, unreadable, or given with --insecure."""
    given = {}
    for part, env in TLS_ENV.items():
        value = getattr(args, f"tls_{part}") or os.environ.get(env) or None
        if value is not None:
            given[part] = value
    if args.insecure and given:
        p.error("--insecure: plain text was asked for, and TLS files too "
                f"({', '.join(f'--tls-{k} {v}' for k, v in given.items())}); give one or the "
                "other (the TLS_* variables count as given)")
    if not given:
        if not args.insecure:
            p.error(NO_TLS_FILES)
        args.tls = None
        return
    missing = [f"--tls-{part} (or ${env})" for part, env in TLS_ENV.items() if part not in given]
    if missing:
        p.error(f"TLS needs the certificate, its key and the CA; missing: {', '.join(missing)}")
    files = TlsFiles(Path(given["cert"]), Path(given["key"]), Path(given["ca"]))
    for part in TLS_ENV:
        path = getattr(files, part)
        if not path.is_file() or not os.access(path, os.R_OK):
            p.error(f"--tls-{part}: {str(path)!r} is not a readable file")
    args.tls = files.load()
    if b"PRIVATE KEY" not in args.tls.key:
        p.error(f"--tls-key: {given['key']!r} holds no PEM private key")
    for part in ("cert", "ca"):
        if b"BEGIN CERTIFICATE" not in getattr(args.tls, part):
            p.error(f"--tls-{part}: {given[part]!r} holds no PEM certificate")


def warn_if_plain_text(service: str, tls: TlsMaterial | None) -> None:
    """The warning every --insecure service logs once it starts."""
    if tls is None:
        log.warning(PLAIN_TEXT_WARNING, service)


def tls_argv(files: TlsFiles | None) -> list[str]:
    """The flags that hand `files` to a child process (launchers); --insecure without."""
    if files is None:
        return ["--insecure"]
    return ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca",
            str(files.ca)]
