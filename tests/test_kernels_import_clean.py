"""Our top-level `kernels` package must not be mistaken for HF's hub `kernels` package.

transformers probes `kernels` (find_spec, then the version of the distribution that provides
it) and, when it thinks the hub package is there, imports `kernelize` & co. from it at import
time. Our editable install maps `kernels` to the `pagedgen` distribution, so the probe reads
pagedgen's version: it stays clean only while that version is outside the hub package's
supported range. The subprocess puts the repo root first on sys.path, as the servers and tests do.
"""

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import io, json, logging, sys, warnings
sys.path.insert(0, sys.argv[1])
warnings.simplefilter("always")
captured_warnings = []
warnings.showwarning = lambda message, *args, **kwargs: captured_warnings.append(str(message))
log_stream = io.StringIO()
logging.basicConfig(stream=log_stream, level=logging.DEBUG)

import kernels
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging
from transformers.utils.import_utils import (
    KERNELS_MAX_VERSION, KERNELS_MIN_VERSION, _is_package_available, is_kernels_available,
)

hf_logging.set_verbosity_warning()
hf_logging.add_handler(logging.StreamHandler(log_stream))
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config).eval()
with torch.inference_mode():
    logits = model(torch.tensor([[1, 2, 3]])).logits
_, probed_version = _is_package_available("kernels", return_version=True)
print(json.dumps({
    "kernels_file": kernels.__file__,
    "kernels_available": is_kernels_available(),
    "probed_version": probed_version,
    "supported_range": [KERNELS_MIN_VERSION, KERNELS_MAX_VERSION],
    "logits_shape": list(logits.shape),
    "kernel_messages": [m for m in captured_warnings + log_stream.getvalue().splitlines()
                        if "kernel" in m.lower()],
}))
"""


def test_transformers_sees_no_hub_kernels_next_to_ours() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(REPO_ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # `import kernels` resolved to our package, not a stray hub install.
    assert Path(report["kernels_file"]).resolve() == REPO_ROOT / "kernels" / "__init__.py"
    assert report["kernels_available"] is False, (
        f"transformers takes our kernels/ for the hub package: it read version "
        f"{report['probed_version']} (supported {report['supported_range']}); keep the pagedgen "
        "version below that range or rename the package"
    )
    assert report["logits_shape"] == [1, 3, 64]
    assert report["kernel_messages"] == []
    assert "kernel" not in result.stderr.lower(), result.stderr
