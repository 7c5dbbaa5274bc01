"""pagedgen-stack (the README's main job): Redis, the index and the engine on the default model
come up as real processes, a chat completion streams through, everything stops cleanly."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from engine_service import LLM, SamplingParams

PROMPT = "Name three colours."


def run_stack(tmp_path, *extra: str) -> str:
    script = shutil.which("pagedgen-stack")
    command = [script] if script else [sys.executable, "-m", "engine_service.tools.stack"]
    done = subprocess.run(
        # A free HTTP port: the default 8000 may be taken on a shared machine.
        command + ["--prompt", PROMPT, "--max-tokens", "16", "--log-dir", str(tmp_path),
                   "--http-port", "0", *extra],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def assert_streamed_the_reference(out: str, model_dir) -> None:
    match = re.search(r"assistant: (.*)\n\n\[usage: (\d+) prompt tokens \((\d+) cached\), "
                      r"(\d+) completion tokens\]\n", out, flags=re.S)
    assert match, out
    text, num_prompt, _, num_completion = match.groups()
    [want] = LLM(model=str(model_dir)).chat(
        [{"role": "user", "content": PROMPT}], SamplingParams(temperature=0, max_tokens=16))
    assert text == want.outputs[0].text
    assert int(num_prompt) == len(want.prompt_token_ids)
    assert int(num_completion) == len(want.outputs[0].token_ids)


def test_stack_streams_a_completion_and_stops_cleanly(smollm2_dir, tmp_path):
    out = run_stack(tmp_path)
    assert_streamed_the_reference(out, smollm2_dir)
    # Secure by default: HTTPS, and how a client verifies the stack (issue 32).
    for line in ("redis ", "prefix index ", "engine ", "http          https://127.0.0.1:",
                 "tls           CA ", "grpcurl       grpcurl -cacert ", "stopped cleanly"):
        assert line in out
    assert "draining" in (tmp_path / "engine-0.log").read_text()  # SIGTERM, not a kill


def test_stack_with_replicas_streams_through_the_router(tiny_llama_dir, tmp_path):
    # The tiny model: what this adds to the test above is the router in front of two engines,
    # not the default model (that test runs it). Two SmolLM2 engines and a third copy for the
    # reference took 31 s of a 2-core CI run; the tiny ones a few.
    out = run_stack(tmp_path, "--replicas", "2", "--model", str(tiny_llama_dir))
    assert_streamed_the_reference(out, tiny_llama_dir)
    assert out.count("engine        ") == 2, out
    assert "router        " in out and "kv-aware over 2 engines" in out, out
    assert "http          https://127.0.0.1:" in out, out
    assert (tmp_path / "certs" / "ca.pem").exists() and "grpcurl -cacert" in out, out
    assert "stopped cleanly" in out
    for i in range(2):  # both engines drained on SIGTERM, neither killed
        assert "draining" in (tmp_path / f"engine-{i}.log").read_text()


def test_stack_with_replicas_and_a_tenant_key_of_the_user_s(tiny_llama_dir, tmp_path):
    """With the user's own key file, whose tenant may not read EngineStats (the default), the
    stack cannot count the routed replicas: it goes on once the router serves (it failed)."""
    from tenancy.keys_tool import add_key

    keys = tmp_path / "keys.toml"
    key = add_key(keys, "me")
    out = run_stack(tmp_path, "--replicas", "2", "--model", str(tiny_llama_dir),
                    "--api-key-file", str(keys), "--api-key", key)
    assert_streamed_the_reference(out, tiny_llama_dir)
    assert "stopped cleanly" in out
