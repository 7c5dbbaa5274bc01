"""An empty API key (--api-key "" or $PAGEDGEN_API_KEY set to nothing, as an empty Kubernetes
Secret or a variable that expanded to nothing gives) is refused at start, naming where it came
from: it used to mean no key at all, an open API the operator meant to close."""

from __future__ import annotations

import pytest

from engine_service.serving import server as engine_server
from openai_api.auth import API_KEY_ENV
from router import server as router_server
from trust.cli_args import tls_argv

ENGINE = ["--model", "unused", "--http-port", "8000"]
ROUTER = ["--engines", "127.0.0.1:1", "--prefix-index", "none", "--http-port", "8000"]


@pytest.mark.parametrize(("parse", "argv"), [(engine_server.parse_args, ENGINE),
                                             (router_server.parse_args, ROUTER)])
def test_an_empty_key_is_refused_by_name(parse, argv, monkeypatch, capsys, test_certs):
    argv = [*argv, *tls_argv(test_certs.files("router"))]
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(SystemExit):
        parse([*argv, "--api-key", ""])
    assert "--api-key must be a non-empty key" in capsys.readouterr().err
    monkeypatch.setenv(API_KEY_ENV, " ")
    with pytest.raises(SystemExit):
        parse(argv)
    assert f"{API_KEY_ENV} must be a non-empty key" in capsys.readouterr().err
    # Set, or not set at all, is as before.
    monkeypatch.setenv(API_KEY_ENV, "k")
    assert parse(argv).api_key == "k"
    monkeypatch.delenv(API_KEY_ENV)
    assert parse(argv).api_key is None
