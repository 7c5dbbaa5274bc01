"""The server README.md's "Calling it" examples call, started as the README starts it.

The README's set-up block runs as written in a fresh folder (its certificates, its key file and
the variables it exports), then its `pagedgen-engine` line, with only the model (the test's,
under the default model's name, which the README's requests name), the ports and the test's
pool settings added. Examples then run in that folder with that environment, their addresses
rewritten to the engine's ports (still `localhost`, which the README's certificate serves).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from string import Template

from engine_service.tools.launch import wait_engine_serving
from prefix_index.tools.redis_process import free_port
from prefix_index.tools.server_process import ServerProcess
from tests.service.conftest import engine_args
from trust.credentials import TlsFiles

README = Path(__file__).resolve().parents[2] / "README.md"
SERVER_MARKER = "<!-- the server the examples call -->"
DOC_GRPC = "localhost:50051"
DOC_HTTP = "localhost:8000"
DOC_MODEL = "SmolLM2-135M-Instruct"
# The test's own settings the README's set-up must not inherit (it makes its own).
UNSET = ("PAGEDGEN_TLS_", "PAGEDGEN_API_KEY", "PAGEDGEN_TENANT_SECRET")


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def block_after(marker: str, language: str) -> str:
    text = README.read_text()
    assert marker in text, f"README.md has no {marker!r} line"
    match = re.match(rf"\s*```{language}\n(.*?)```", text[text.index(marker) + len(marker):],
                     flags=re.S)
    assert match, f"README.md: no ```{language} block right after {marker!r}"
    return match.group(1)


def server_block() -> tuple[str, str]:
    """The set-up commands, and the one `pagedgen-engine ... &` line that ends the block."""
    lines = block_after(SERVER_MARKER, "sh").strip().splitlines()
    engine = lines[-1].strip()
    assert engine.startswith("pagedgen-engine ") and engine.endswith("&"), (
        f"the README's server block does not end with `pagedgen-engine ... &`: {engine!r}")
    return "\n".join(lines[:-1]), engine.removesuffix("&")


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(UNSET)}
    # The console scripts of the interpreter running the tests, as a user's shell finds them.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_set_up(commands: str, folder: Path) -> dict[str, str]:
    """Runs the set-up commands in bash in `folder`; returns the environment they leave."""
    env_file = folder.parent / f"{folder.name}.env"
    script = f"set -e\n{commands}\nenv -0 > {shlex.quote(str(env_file))}\n"
    done = subprocess.run(["bash", "-c", script], cwd=folder, env=base_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the README's set-up failed:\n{commands}\n{done.stderr}"
    pairs = env_file.read_text().split("\0")
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


class ReadmeEngine(ServerProcess):
    """The README's engine command, run in its set-up's folder."""

    name = "engine"

    def __init__(self, argv: list[str], folder: Path, env: dict[str, str], port: int,
                 tls: TlsFiles, log_path: Path) -> None:
        self.argv, self.folder, self.env, self.tls = argv, folder, env, tls
        self.host, self.port, self.log_path = "127.0.0.1", port, log_path

    def start(self) -> ReadmeEngine:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=self.folder, env=self.env,
                                         stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_engine_serving(self.target, 300, self.proc, self.log_path, self.tls)
        except BaseException:
            self.kill()
            raise
        return self


@dataclass
class ReadmeServer:
    folder: Path  # where the README's set-up ran; the examples run there
    env: dict[str, str]  # the shell's environment after the set-up
    variables: dict[str, str]  # what the set-up exported
    engine: ReadmeEngine
    grpc_port: int
    http_port: int
    metrics_port: int

    def localize(self, example: str) -> str:
        """The example with the README's addresses replaced by this engine's ports."""
        return (example.replace(DOC_GRPC, f"localhost:{self.grpc_port}")
                .replace(DOC_HTTP, f"localhost:{self.http_port}"))

    def run_shell(self, example: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", self.localize(example)], cwd=self.folder,
                              env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def run_python(self, example: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", self.localize(example)], cwd=self.folder,
                              env=self.env, capture_output=True, text=True, timeout=timeout_s)


def flag_value(argv: list[str], flag: str) -> str:
    assert flag in argv, f"the README's engine has no {flag}: {argv}"
    return argv[argv.index(flag) + 1]


@contextmanager
def readme_server(model_dir: Path, folder: Path) -> Iterator[ReadmeServer]:
    """The README's set-up run in `folder`, its engine serving on the test model until exit."""
    set_up, engine_line = server_block()
    env = run_set_up(set_up, folder)
    variables = {k: env[k] for k in re.findall(r"\bexport\s+(\w+)=", set_up)}
    # The engine line's words as bash gives them: quotes removed, the set-up's variables
    # expanded (an unset one fails here, as it would leave a user's flag empty).
    argv = [Template(word).substitute(env) for word in shlex.split(engine_line)]
    doc_http_port = DOC_HTTP.rsplit(":", 1)[1]
    assert flag_value(argv, "--http-port") == doc_http_port, argv
    assert "--port" not in argv, f"the README's engine sets its own gRPC port: {argv}"
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    argv[argv.index("--http-port") + 1] = str(http_port)
    script = shutil.which(argv[0], path=env["PATH"])
    base = [script] if script else [sys.executable, "-m", "engine_service.serving.server"]
    # The test's pool settings, at the README's log level (its readiness line is INFO).
    settings = engine_args(metrics_port, None)
    del settings[settings.index("--log-level"):settings.index("--log-level") + 2]
    command = [*base, "--model", str(model_dir), "--served-model-name", DOC_MODEL,
               *settings, *argv[1:], "--port", str(grpc_port)]
    # Waiting for SERVING presents the README's own engine certificate, trusting its CA.
    tls = TlsFiles(*(folder / flag_value(argv, f) for f in ("--tls-cert", "--tls-key",
                                                            "--tls-ca")))
    log_path = folder.parent / f"{folder.name}.log"
    engine = ReadmeEngine(command, folder, env, grpc_port, tls, log_path)
    with engine.start():
        yield ReadmeServer(folder, env, variables, engine, grpc_port, http_port, metrics_port)
