"""The README's offline-API example runs as written (on the default model)."""

import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_readme_offline_example_runs(smollm2_dir):
    readme = (REPO_ROOT / "README.md").read_text()
    [example] = [
        b
        for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
        if "from engine_service import LLM" in b
    ]
    done = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr
    # Each result line ends with its finish reason and cached-token count.
    assert len(re.findall(r" (length|stop) \d+\n", done.stdout)) == 2, done.stdout
