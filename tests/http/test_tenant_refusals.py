"""A tenant's refusals over HTTP, on an engine with a key file (pagedgen-keys' own): a
`priority` the tenant may not set is a 403 in OpenAI's shape naming the field (`param`), as a
400 names a bad one."""

from __future__ import annotations

import subprocess

import openai
import pytest

from tests.http.conftest import start_engine


@pytest.fixture(scope="module")
def tenant_engine(tiny_llama_dir, tmp_path_factory, test_certs):
    folder = tmp_path_factory.mktemp("tenant")
    keys = folder / "keys.toml"
    added = subprocess.run(["pagedgen-keys", "add", "--file", str(keys), "--tenant", "acme"],
                           capture_output=True, text=True, timeout=60, check=True)
    [key] = [word for word in added.stdout.split() if word.startswith("pg-")]
    assert "may_set_priority = false" in keys.read_text()  # the default
    engine = start_engine(tiny_llama_dir, folder / "engine.log", test_certs,
                          ["--api-key-file", str(keys)])
    try:
        yield engine, key
    finally:
        engine.process.terminate()


def test_a_priority_the_tenant_may_not_set_is_a_403_naming_it(tenant_engine):
    engine, key = tenant_engine
    with engine.openai(key, max_retries=0, timeout=120) as client:
        with pytest.raises(openai.PermissionDeniedError) as refused:
            client.completions.create(model=engine.model, prompt="hi", max_tokens=2,
                                      extra_body={"priority": 5})
        error = refused.value.body
        assert error["type"] == "permission_error"
        assert error["param"] == "priority"
        assert error["message"].startswith("priority must be 0"), error
        # The same request at the default priority is served.
        reply = client.completions.create(model=engine.model, prompt="hi", max_tokens=2)
        assert reply.choices[0].finish_reason == "length"
