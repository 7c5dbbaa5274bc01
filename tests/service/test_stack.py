"""pagedgen-stack (the README's main job): Redis, the index and the engine on the default model
come up as real processes, a chat completion streams through, everything stops cleanly."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from engine_service import LLM, SamplingParams

PROMPT = "Name three colours."


def test_stack_streams_a_completion_and_stops_cleanly(smollm2_dir, tmp_path):
    script = shutil.which("pagedgen-stack")
    command = [script] if script else [sys.executable, "-m", "engine_service.tools.stack"]
    done = subprocess.run(
        command + ["--prompt", PROMPT, "--max-tokens", "16", "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    match = re.search(r"assistant: (.*)\n\n\[usage: (\d+) prompt tokens \((\d+) cached\), "
                      r"(\d+) completion tokens\]\n", out, flags=re.S)
    assert match, out
    text, num_prompt, _, num_completion = match.groups()
    [want] = LLM(model=str(smollm2_dir)).chat(
        [{"role": "user", "content": PROMPT}], SamplingParams(temperature=0, max_tokens=16))
    assert text == want.outputs[0].text
    assert int(num_prompt) == len(want.prompt_token_ids)
    assert int(num_completion) == len(want.outputs[0].token_ids)
    for line in ("redis ", "prefix index ", "engine ", "stopped cleanly"):
        assert line in out
    assert "draining" in (tmp_path / "engine-0.log").read_text()  # SIGTERM, not a kill
