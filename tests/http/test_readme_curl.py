"""The README's HTTP examples run as written against the server the README says they call,
started as written (tests/support/readme_server.py: its set-up block in a fresh folder, the
test model under the default model's name, free ports in place of its own): the `curl -N`
stream after the `tested by` marker, and the openai client's, over HTTPS with the CA and the
key the set-up exported. The engine serves HTTPS only and holds the key, so an example without
either fails here as it would for a user."""

from __future__ import annotations

import json

import pytest

from tests.support.readme_server import DOC_HTTP, DOC_MODEL, block_after, code_blocks, readme_server

MARKER = "<!-- tested by tests/http/test_readme_curl.py -->"


@pytest.fixture(scope="module")
def readme(tiny_llama_dir, tmp_path_factory):
    with readme_server(tiny_llama_dir, tmp_path_factory.mktemp("readme_http")) as server:
        yield server


def curl_block() -> str:
    block = block_after(MARKER, "bash")
    assert "curl -N" in block and f"https://{DOC_HTTP}" in block, block
    return block


def test_readme_curl_streams_a_chat_completion(readme):
    done = readme.run_shell(curl_block())
    assert done.returncode == 0, done.stderr
    events = [line for line in done.stdout.splitlines() if line]
    assert events[-1] == "data: [DONE]", done.stdout
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert all(line.startswith("data: {") for line in events[:-1]), done.stdout
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == DOC_MODEL
               for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_readme_curl_needs_its_key_and_its_ca(readme):
    """Without the Authorization header the engine answers 401; without the CA, curl does
    not trust it: what the example sends is what makes it pass."""
    block = curl_block()
    header = '-H "Authorization: Bearer $KEY" '
    assert header in block
    status_only = "curl -sS -o /dev/null -w '%{http_code}'"
    no_key = readme.run_shell(block.replace(header, "").replace("curl -N", status_only))
    assert no_key.returncode == 0 and no_key.stdout == "401", no_key.stdout
    no_ca = readme.run_shell(block.replace('--cacert "$CA" ', ""))
    assert no_ca.returncode == 60, (no_ca.returncode, no_ca.stderr)  # peer certificate not trusted


def test_readme_openai_client_example(readme):
    [example] = [b for b in code_blocks("python") if "import openai" in b]
    assert f"https://{DOC_HTTP}/v1" in example
    done = readme.run_python(example)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "Warning" not in done.stderr, done.stderr
