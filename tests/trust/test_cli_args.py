"""The TLS flags as every console script parses them: files or variables, all three or none
refused unless --insecure, --insecure alone, and errors that name the flag and the value."""

from __future__ import annotations

import pytest

from engine_service.serving.server import parse_args as engine_args
from prefix_index.server.main import parse_args as index_args
from router.server import parse_args as router_args
from tests.trust.conftest import files

PARSERS = {"index": (index_args, []), "router": (router_args, ["--engines", "127.0.0.1:1"]),
           "engine": (engine_args, [])}


@pytest.fixture(autouse=True)
def no_tls_environment(monkeypatch):
    for name in ("PAGEDGEN_TLS_CERT", "PAGEDGEN_TLS_KEY", "PAGEDGEN_TLS_CA"):
        monkeypatch.delenv(name, raising=False)


def refused(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("service", PARSERS)
def test_files_load_and_plain_text_only_with_insecure(service, certs, capsys):
    parse, base = PARSERS[service]
    err = refused(parse, base, capsys)
    assert "no TLS files" in err and "--insecure" in err and "pagedgen-certs" in err
    assert parse([*base, "--insecure"]).tls is None
    tls = files(certs, "router")
    args = parse([*base, "--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
                  "--tls-ca", str(tls.ca)])
    assert args.tls.cert == tls.cert.read_bytes() and args.tls.files == tls


@pytest.mark.parametrize("service", PARSERS)
def test_variables_stand_for_the_flags(service, certs, monkeypatch):
    parse, base = PARSERS[service]
    tls = files(certs, "index")
    monkeypatch.setenv("PAGEDGEN_TLS_CERT", str(tls.cert))
    monkeypatch.setenv("PAGEDGEN_TLS_KEY", str(tls.key))
    monkeypatch.setenv("PAGEDGEN_TLS_CA", str(tls.ca))
    assert parse(base).tls.key == tls.key.read_bytes()


def test_bad_tls_settings_are_refused_by_name(certs, capsys, tmp_path):
    tls = files(certs, "index")
    err = refused(index_args, ["--tls-cert", str(tls.cert)], capsys)
    assert "missing: --tls-key" in err and "--tls-ca" in err
    err = refused(index_args, ["--tls-cert", str(tls.cert), "--tls-key", str(tmp_path / "nope"),
                               "--tls-ca", str(tls.ca)], capsys)
    assert "--tls-key" in err and "nope" in err and "not a readable file" in err
    err = refused(index_args, ["--tls-cert", str(tls.key), "--tls-key", str(tls.key),
                               "--tls-ca", str(tls.ca)], capsys)
    assert "--tls-cert" in err and "no PEM certificate" in err
    err = refused(index_args, ["--insecure", "--tls-cert", str(tls.cert), "--tls-key",
                               str(tls.key), "--tls-ca", str(tls.ca)], capsys)
    assert "--insecure" in err and "one or the other" in err
    err = refused(engine_args, ["--tls-server-only", "--insecure"], capsys)
    assert "--tls-server-only" in err and "needs TLS" in err


def test_pagedgen_certs_is_idempotent_and_keys_are_private(certs):
    from tests.trust.conftest import make_certs

    before = {p.name: p.read_bytes() for p in certs.iterdir()}
    make_certs(certs, "--engine", "engine-a", "--router")
    assert {p.name: p.read_bytes() for p in certs.iterdir()} == before
    for key in certs.glob("*-key.pem"):
        assert key.stat().st_mode & 0o777 == 0o600, key
