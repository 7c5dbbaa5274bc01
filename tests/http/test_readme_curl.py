"""The README's HTTP examples run as written against the server the README says they call,
started as written (the test model under the default model's name, free ports in place of its
own, its address in place of localhost:8000): the `curl -N` stream after the `tested by`
marker, and the openai client's."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from engine_service.tools.launch import EngineProcess
from prefix_index.tools.redis_process import free_port
from tests.http.conftest import HttpEngine
from tests.service.conftest import engine_args

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- tested by tests/http/test_readme_curl.py -->"
SERVER_MARKER = "<!-- the server the examples call -->"
DOC_ADDRESS = "localhost:8000"
DOC_HTTP_PORT = DOC_ADDRESS.rsplit(":", 1)[1]
DOC_MODEL = "SmolLM2-135M-Instruct"  # what the README's requests name


def curl_block() -> str:
    text = README.read_text()
    assert MARKER in text, f"README.md has no {MARKER!r} line"
    match = re.match(r"\s*```bash\n(.*?)```", text[text.index(MARKER) + len(MARKER):],
                     flags=re.S)
    assert match, f"README.md: no ```bash block right after {MARKER!r}"
    return match.group(1)


def server_command() -> list[str]:
    """The one command in the ```sh block after SERVER_MARKER."""
    text = README.read_text()
    assert SERVER_MARKER in text, f"README.md has no {SERVER_MARKER!r} line"
    match = re.match(r"\s*```sh\n(.*?)```", text[text.index(SERVER_MARKER) + len(SERVER_MARKER):],
                     flags=re.S)
    assert match, f"README.md: no ```sh block right after {SERVER_MARKER!r}"
    [line] = match.group(1).strip().splitlines()
    return shlex.split(line)


@pytest.fixture(scope="module")
def readme_engine(tiny_llama_dir, tmp_path_factory):
    # The README's command as written, after the test settings: only the model (the test's,
    # under the default model's name, which the README's requests use) and the ports differ.
    argv = server_command()
    assert argv[0] == "pagedgen-engine", f"the examples' server is not one engine: {argv}"
    assert argv.count(DOC_HTTP_PORT) == 1, f"the examples' server is not on {DOC_ADDRESS}: {argv}"
    http_port, metrics_port = free_port(), free_port()
    log_path = tmp_path_factory.mktemp("readme") / "engine.log"
    as_written = [str(http_port) if arg == DOC_HTTP_PORT else arg for arg in argv[1:]]
    process = EngineProcess(tiny_llama_dir, [*engine_args(metrics_port, None),
                                             "--served-model-name", DOC_MODEL, *as_written],
                            log_path=log_path).start()
    engine = HttpEngine(process, http_port, metrics_port, log_path, None)  # --insecure
    try:
        yield engine
    finally:
        engine.process.terminate()


def test_readme_curl_streams_a_chat_completion(readme_engine):
    block = curl_block()
    assert "curl -N" in block and DOC_ADDRESS in block
    address = readme_engine.base_url.removeprefix("http://")
    done = subprocess.run(["bash", "-c", block.replace(DOC_ADDRESS, address)],
                          capture_output=True, text=True, timeout=120)
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


def test_readme_openai_client_example(readme_engine):
    [example] = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
                 if "from openai import OpenAI" in b]
    example = example.replace(DOC_ADDRESS, readme_engine.base_url.removeprefix("http://"))
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
