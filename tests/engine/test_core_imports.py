"""Building and running an engine imports no torch._dynamo: its import took about 1 s of every
engine start (measured on this CPU: a core's build went from 2.4 s to 0.8 s without it), and
nothing on the CPU path compiles. It came from the model's construction on the meta device,
where nn.Embedding's random init runs normal_ as a Python decomposition that imports dynamo
first; the loader assigns the checkpoint's weights anyway.

Run in a fresh interpreter (the repository root first on sys.path), which reports the import
chain that first reached torch._dynamo, if one did."""

import json
import subprocess
import sys
from pathlib import Path

from tests.support.import_witness import witness_source

REPO_ROOT = Path(__file__).resolve().parents[2]

PROBE = witness_source("torch._dynamo") + r"""
from engine_service.llm import LLM

llm = LLM(sys.argv[2], num_blocks=64)
[output] = llm.generate(["Hello there"])
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "chain": first_import,
                  "tokens": len(output.outputs[0].token_ids)}))
"""


def test_building_and_running_an_engine_imports_no_dynamo(tiny_llama_dir):
    done = subprocess.run([sys.executable, "-c", PROBE, str(REPO_ROOT), str(tiny_llama_dir)],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tokens"] > 0  # the engine ran a request
    assert not report["dynamo"], f"torch._dynamo was imported from {report['chain']}"
