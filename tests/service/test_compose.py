"""compose.yaml is valid against the Compose spec and wires the stack the way DESIGN.md says."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import yaml

from engine_service.serving.server import parse_args as engine_args
from prefix_index.server.main import parse_args as index_args
from prefix_index.tools.server_options import STOP_AFTER_DRAIN_S
from router.server import parse_args as router_args
from trust.cli_args import TLS_ENV, tls_argv

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
# The services that hold a certificate, and its role (its folder of the certs volume).
CERT_ROLES = {"prefix-index": "index", "engine": "engine", "engine-gpu1": "engine",
              "engine-cpu": "engine", "engine-tp2": "engine", "router": "router"}


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


@pytest.fixture(autouse=True)
def tls_environment(monkeypatch, test_certs):
    """compose hands every service its TLS files in PAGEDGEN_TLS_* (a service given none
    refuses to start): the commands parsed here read the session's from there too. The test
    that checks each service's own variables sets them itself."""
    files = test_certs.files("engine")
    for env, path in zip(TLS_ENV.values(), (files.cert, files.key, files.ca), strict=True):
        monkeypatch.setenv(env, str(path))


def test_compose_matches_the_compose_spec():
    binary = shutil.which("check-jsonschema")
    assert binary, "check-jsonschema is not installed (pip install check-jsonschema)"
    done = subprocess.run([binary, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dependencies_healthchecks_and_gpu(services):
    assert "redis-cli ping" in services["redis"]["healthcheck"]["test"][-1]
    index = services["prefix-index"]
    assert index["depends_on"]["redis"] == {"condition": "service_healthy"}
    assert "localhost:50061" in index["healthcheck"]["test"]
    gpu, cpu = services["engine"], services["engine-cpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    assert "--device=cuda" in gpu["command"] and "resources" not in cpu["deploy"]
    for engine in (gpu, cpu):
        assert engine["depends_on"]["prefix-index"] == {"condition": "service_healthy"}
        assert engine["depends_on"]["prepare-model"] == {
            "condition": "service_completed_successfully"}
        assert any(v.startswith("pagedgen-cache:/cache") for v in engine["volumes"])
        assert "localhost:50051" in engine["healthcheck"]["test"]
    for name in ("prefix-index", "prepare-model", "engine", "engine-cpu"):
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile"
        assert (ROOT / services[name]["build"]["dockerfile"]).exists()


def test_healthchecks_check_the_role_not_the_host(services):
    """Each `launch --check` probe names the role the server's certificate must hold, so it
    keeps working with certificates (your own CA's) that do not name localhost."""
    from engine_service.tools.launch import parse_check_args

    probes = {name: service["healthcheck"]["test"] for name, service in services.items()
              if "engine_service.tools.launch" in service.get("healthcheck", {}).get("test", [])}
    assert set(probes) == set(CERT_ROLES), probes
    for name, test in probes.items():
        assert test[:4] == ["CMD", "python", "-m", "engine_service.tools.launch"], name
        assert parse_check_args(test[4:]).role == CERT_ROLES[name], name


def test_each_gpu_engine_has_a_gpu_of_its_own(services):
    """A reservation by `count` hands every replica of a service the same first GPUs, so a GPU
    engine is a service per GPU, each reserving its own by id, one replica each; the docs never
    offer --scale for them."""
    reserved = []
    for name in ("engine", "engine-gpu1"):
        engine = services[name]
        [device] = engine["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device and len(device["device_ids"]) == 1, name
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        assert engine["deploy"]["replicas"] == 1 and engine["image"] == "pagedgen:gpu", name
        assert "--device=cuda" in engine["command"], name
        reserved += device["device_ids"]
    assert len(reserved) == len(set(reserved)), reserved
    # A one-GPU host runs --profile gpu: the second GPU's engine is not in it.
    assert "gpu" not in services["engine-gpu1"]["profiles"]
    for doc in (COMPOSE, ROOT / "README.md"):
        assert not re.search(r"--scale engine=[1-9]", doc.read_text()), doc.name


def test_cpu_replicas_fit_a_small_host(services, host_paths, tmp_path):
    """Torch threads wait for each other at every op: the default CPU replicas' threads, all
    together, fit a 2-core host, and each replica's CPU limit leaves its front a CPU."""
    from engine_service.serving.torch_threads import core_torch_threads

    cpu = services["engine-cpu"]
    args = engine_args([_on_this_machine(a, host_paths["engine-cpu"]) for a in cpu["command"][1:]])
    limit = float(cpu["cpus"])
    (tmp_path / "cpu.max").write_text(f"{int(limit * 100_000)} 100000")  # what --cpus sets
    for host_cores in (2, 4, 16):
        threads = core_torch_threads(args.torch_threads, "cpu", torch_default=host_cores,
                                     environ={}, root=tmp_path, affinity=host_cores)
        assert cpu["deploy"]["replicas"] * threads <= 2, (host_cores, threads)
        assert threads < limit, (host_cores, threads)


def test_commands_parse_with_the_real_console_scripts(services, host_paths):
    """The flags in compose.yaml are ones the servers accept (argparse exits on a bad one)."""
    for name in ("engine", "engine-gpu1", "engine-cpu"):
        script, *argv = services[name]["command"]
        assert script == "pagedgen-engine"
        args = engine_args([_on_this_machine(a, host_paths[name]) for a in argv])
        assert args.prefix_index == "prefix-index:50061" and args.port == 50051
    script, *argv = services["prefix-index"]["command"]
    assert script == "pagedgen-prefix-index"
    # The URL, password included, comes from the environment its entrypoint sets (below).
    assert not any(arg.startswith("--redis-url") for arg in argv)
    assert index_args(argv).port == 50061
    script, *argv = services["router"]["command"]
    assert script == "pagedgen-router"
    args = router_args([_on_this_machine(a, host_paths["router"]) for a in argv])
    assert args.prefix_index == "prefix-index:50061" and args.engine_list == []
    assert args.policy == "kv-aware" and args.port == 50051


def _duration_s(text: str) -> float:
    """A compose duration ("50s", "1m30s") in seconds."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", text)
    assert parts is not None and text, f"not a duration of minutes and seconds: {text!r}"
    return int(parts[1] or 0) * 60 + int(parts[2] or 0)


def test_the_kill_comes_after_the_drain_and_the_stop(services, host_paths):
    """Each server's stop_grace_period outlasts its --grace-s and the stop after it (a client
    that takes no bytes holds gRPC's stop for its keepalive timeout): the kill does not cut a
    drain short."""
    parse = {"pagedgen-engine": engine_args, "pagedgen-router": router_args,
             "pagedgen-prefix-index": index_args}
    checked = []
    for name, service in services.items():
        script, *argv = service.get("command") or [""]
        if script not in parse:
            continue
        args = parse[script]([_on_this_machine(a, host_paths[name]) for a in argv])
        kill_after = _duration_s(service.get("stop_grace_period", "10s"))
        assert kill_after > args.grace_s + STOP_AFTER_DRAIN_S, \
            f"{name}: stop_grace_period {kill_after}s <= --grace-s {args.grace_s} + the stop " \
            f"after it {STOP_AFTER_DRAIN_S}"
        checked.append(name)
    assert {"engine", "engine-cpu", "engine-tp2", "prefix-index", "router"} <= set(checked)


def test_the_tensor_parallel_engine_spans_two_gpus(services, host_paths):
    tp2 = services["engine-tp2"]
    assert tp2["profiles"] == ["gpu-tp2"] and tp2["image"] == services["engine"]["image"]
    [device] = tp2["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == 2 and device["capabilities"] == ["gpu"]
    script, *argv = tp2["command"]
    args = engine_args([_on_this_machine(a, host_paths["engine-tp2"]) for a in argv])
    assert script == "pagedgen-engine" and args.tensor_parallel_size == 2
    assert args.device == "cuda" and args.prefix_index == "prefix-index:50061"


def test_the_router_fronts_scalable_engine_replicas(services, host_paths):
    """Only the router is published; replicas have no fixed id or host port (so --scale works)
    and register hostname:50051 (the default advertised address when bound to 0.0.0.0)."""
    router = services["router"]
    assert "50051:50051" in router["ports"]
    assert router["depends_on"]["prefix-index"] == {"condition": "service_healthy"}
    assert "localhost:50051" in router["healthcheck"]["test"]
    assert set(router["profiles"]) == {"cpu", "gpu"}
    for name in ("engine", "engine-cpu"):
        engine = services[name]
        assert "ports" not in engine, name
        args = engine_args([_on_this_machine(a, host_paths[name])
                            for a in engine["command"][1:]])
        assert args.engine_id is None and args.advertise_address == "" and args.host == "0.0.0.0"
    assert services["engine-cpu"]["deploy"]["replicas"] >= 2


def test_healthcheck_probe_reports_serving(engine_server, services):
    done = subprocess.run(["python", "-m", "engine_service.tools.launch", "--check",
                           engine_server.target,
                           *tls_argv(engine_server.certs.files("client"))],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("SERVING"), done
    # The engines' healthcheck as written (its role included), with an engine's certificate
    # from PAGEDGEN_TLS_* as in the container.
    probe = [engine_server.target if arg == "localhost:50051" else arg
             for arg in services["engine-cpu"]["healthcheck"]["test"][1:]]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("SERVING"), done


def test_every_service_runs_tls_with_certificates_from_the_certs_job(services, certs_volume):
    """The `certs` job's command is one pagedgen-certs accepts; the index, the engines and the
    router read their own certificate from the volume it fills (issue 32), each from its
    role's folder of it, mounted read-only."""
    from trust.certs_tool import parse_args as certs_args

    script, *argv = services["certs"]["command"]
    assert script == "pagedgen-certs"
    made = certs_args(argv)
    assert made.router and made.index and made.engine == [""]
    assert {"localhost", "router", "prefix-index"} <= set(made.host)
    for name, stem in CERT_ROLES.items():
        env = {k: v for k, v in services[name]["environment"].items() if "TLS" in k}
        assert env == {"PAGEDGEN_TLS_CERT": "/certs/cert.pem",
                       "PAGEDGEN_TLS_KEY": "/certs/key.pem",
                       "PAGEDGEN_TLS_CA": "/certs/ca.pem"}, name
        assert {"type": "volume", "source": "pagedgen-certs", "target": "/certs",
                "read_only": True, "volume": {"subpath": stem}} in services[name]["volumes"], name
        for path in env.values():
            assert (certs_volume / stem / Path(path).name).is_file(), (name, path)
    # A Docker that ignored the subpath would mount the volume's root: no service may find its
    # certificate and key there (it refuses to start), rather than start seeing every key.
    assert not (certs_volume / "cert.pem").exists() and not (certs_volume / "key.pem").exists()
    assert services["prefix-index"]["depends_on"]["certs"] == {
        "condition": "service_completed_successfully"}


def test_no_service_but_the_certs_job_sees_the_ca_key_or_another_role_s_key(services,
                                                                            certs_volume):
    """Every service runs as the same uid, and the certs volume holds the CA's key and every
    role's key: a service that could read them could mint any role's certificate (a published
    router an engine's). Each sees its role's folder alone: its certificate and key and the CA
    certificate, the same as the job made."""
    assert (certs_volume / "ca-key.pem").is_file()  # the job's alone
    for name, service in services.items():
        if name == "certs":
            continue
        assert "volumes_from" not in service, name
        mounts = [m for m in service.get("volumes", []) if "pagedgen-certs" in str(m)]
        if name not in CERT_ROLES:
            assert mounts == [], name
            continue
        [mount] = mounts
        assert isinstance(mount, dict) and mount["read_only"] is True, name
        role = CERT_ROLES[name]
        seen = certs_volume / mount["volume"]["subpath"]
        made = {"ca.pem": "ca.pem", "cert.pem": f"{role}.pem", "key.pem": f"{role}-key.pem"}
        assert sorted(p.name for p in seen.iterdir()) == sorted(made), name
        for file in seen.iterdir():
            assert file.read_bytes() == (certs_volume / made[file.name]).read_bytes(), file
        assert (seen / "key.pem").stat().st_mode & 0o077 == 0, "keys stay 0600"


def test_the_certs_job_keeps_what_it_made(services, certs_volume):
    """`docker compose up` runs the certs job again: the CA clients trust and every role's
    files stay as they were."""
    before = {p: p.read_bytes() for p in certs_volume.rglob("*") if p.is_file()}
    done = _run_certs_job(services["certs"], certs_volume)
    assert "wrote" not in done.stdout, done.stdout
    assert {p: p.read_bytes() for p in certs_volume.rglob("*") if p.is_file()} == before


def _run_certs_job(job: dict, volume: Path) -> subprocess.CompletedProcess:
    """The certs job's entrypoint and command as written, its volume (/certs) here `volume`."""
    assert job["volumes"] == ["pagedgen-certs:/certs"]
    argv = [_interpolated(a).replace("/certs", str(volume))
            for a in (*job["entrypoint"], *job["command"])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def certs_volume(services, tmp_path_factory) -> Path:
    """The `pagedgen-certs` volume as the certs job leaves it."""
    volume = tmp_path_factory.mktemp("certs-volume")
    _run_certs_job(services["certs"], volume)
    return volume


def _interpolated(text: str) -> str:
    """What compose hands the container for a string of compose.yaml: $$ is a literal $."""
    return text.replace("$$", "$")


def _header_commands(section: str) -> list[str]:
    """The commands of a section of compose.yaml's header (`# Secrets`, `# API keys`), as
    written: the indented block after its first lines."""
    lines = COMPOSE.read_text().split(f"\n# {section}", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#   "))
    commands = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        commands.append(line.removeprefix("#   "))
    return commands


@pytest.fixture(scope="module")
def header_dir(tmp_path_factory) -> Path:
    """A scratch directory (compose.yaml's, as it were) where the header's secret-making
    commands ran as written."""
    work = tmp_path_factory.mktemp("compose")
    commands = _header_commands("Secrets")
    assert any(c.startswith("pagedgen-keys add") for c in commands), commands
    done = subprocess.run(["bash", "-euc", "\n".join(commands)], cwd=work, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return work


@pytest.fixture(scope="module")
def secret_files(header_dir) -> dict[str, Path]:
    """compose.yaml's secrets, as the header's commands made them: secret name -> the file
    compose would mount at /run/secrets/<name>."""
    declared = yaml.safe_load(COMPOSE.read_text())["secrets"]
    files = {}
    for name, source in declared.items():
        assert set(source) == {"file"}, f"secret {name}: {source} (a file, never inline)"
        assert source["file"].startswith("./secrets/"), source
        files[name] = header_dir / source["file"]
        assert files[name].is_file(), f"the header's commands do not make {source['file']}"
    return files


@pytest.fixture(scope="module")
def host_paths(services, secret_files, header_dir, certs_volume) -> dict[str, dict[str, Path]]:
    """service -> {a path in its container: where that lies here}: its compose secrets, its
    bind mounts (relative to compose.yaml: the header's directory) and its folder of the
    certs volume."""
    paths = {}
    for name, service in services.items():
        seen = {f"/run/secrets/{secret}": secret_files[secret]
                for secret in service.get("secrets", [])}
        for mount in service.get("volumes", []):
            if isinstance(mount, str):
                continue  # pagedgen-cache: no file a command names
            if mount["type"] == "bind":
                seen[mount["target"]] = header_dir / mount["source"]
            elif mount["source"] == "pagedgen-certs":
                seen[mount["target"]] = certs_volume / mount["volume"]["subpath"]
        paths[name] = seen
    return paths


def _on_this_machine(text: str, paths: dict[str, Path]) -> str:
    """`text` with each path of a container (host_paths' keys) where it lies here."""
    for inside in sorted(paths, key=len, reverse=True):
        text = text.replace(inside, str(paths[inside]))
    return text


def test_only_the_router_client_ports_are_published(services):
    """The front door (gRPC and HTTP, TLS with an API key) is the only way in: the index, the
    engines, Redis and every metrics port stay on the internal network (issue 32)."""
    published = {name: service["ports"] for name, service in services.items()
                 if "ports" in service}
    assert published == {"router": ["50051:50051", "8000:8000"]}, published
    args = router_args([a for a in services["router"]["command"][1:]
                        if not a.startswith(("--api-key-file", "--tenant-secret-file"))])
    assert (args.port, args.http_port) == (50051, 8000)
    for name in ("prefix-index", "engine", "engine-cpu", "router"):
        assert "network_mode" not in services[name], name


def test_redis_takes_its_password_from_a_secret_and_bounds_its_memory(services, secret_files,
                                                                      host_paths, tmp_path):
    """Runs compose's Redis entrypoint and command with the real redis-server (the image's
    docker-entrypoint.sh, which only drops to the redis user, stands in as `exec "$@"`): the
    password is the secret's, maxmemory and noeviction are set, no argument holds the password,
    and the healthcheck is healthy only with the password."""
    import socket

    redis = services["redis"]
    assert redis["secrets"] == ["redis-password"]
    password = secret_files["redis-password"].read_text()
    assert password and password.strip() == password, "the password sits in a URL as it is"
    command = [_interpolated(arg) for arg in redis["command"]]
    assert not any(password in arg for arg in command)
    assert command[command.index("--maxmemory") + 1] == "512mb"
    # noeviction: an engine's keys in the index are one consistent whole (compose.yaml says why).
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker-entrypoint.sh").write_text('#!/bin/sh\nexec "$@"\n')
    (bin_dir / "docker-entrypoint.sh").chmod(0o755)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    entrypoint = [_on_this_machine(_interpolated(a), host_paths["redis"])
                  for a in redis["entrypoint"]]
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin:/usr/local/bin"}
    # Its own process group: the entrypoint's shell pipes into redis-server, which a signal
    # to the shell alone leaves running (it outlived every run of this test before).
    server = subprocess.Popen([*entrypoint, *command, "--port", str(port), "--dir",
                               str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        def cli(*argv: str, auth: str | None = None) -> str:
            return subprocess.run(["redis-cli", "-p", str(port), *argv], capture_output=True,
                                  text=True, timeout=10,
                                  env={**env, **({"REDISCLI_AUTH": auth} if auth else {})}
                                  ).stdout.strip()

        for _ in range(100):
            if cli("ping", auth=password) == "PONG":
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert cli("ping", auth=password) == "PONG", server.stdout
        assert "NOAUTH" in cli("ping")
        assert cli("config", "get", "maxmemory-policy", auth=password).split() == [
            "maxmemory-policy", "noeviction"]
        assert cli("config", "get", "maxmemory", auth=password).split()[1] == str(512 << 20)
        check = _on_this_machine(_interpolated(redis["healthcheck"]["test"][1]),
                                 host_paths["redis"]).replace("redis-cli", f"redis-cli -p {port}")
        assert redis["healthcheck"]["test"][0] == "CMD-SHELL"
        assert subprocess.run(["sh", "-c", check], env=env, timeout=10).returncode == 0
        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-password")
        bad = check.replace(str(secret_files["redis-password"]), str(wrong))
        assert subprocess.run(["sh", "-c", bad], env=env, timeout=10).returncode != 0
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        assert _group_gone(server.pid, timeout_s=30), "redis-server outlived the test"


def _group_gone(pgid: int, timeout_s: float) -> bool:
    """Whether every process of the group has exited within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_index_reads_the_password_in_its_redis_url_from_the_secret(services, secret_files,
                                                                        host_paths):
    """The index's entrypoint puts PAGEDGEN_REDIS_URL, with the secret's password, in its
    environment (not its arguments), and the real parser takes the URL from there."""
    index = services["prefix-index"]
    assert index["secrets"] == ["redis-password"]
    entrypoint = [_on_this_machine(_interpolated(a), host_paths["prefix-index"])
                  for a in index["entrypoint"]]
    script = ("import sys; from prefix_index.server.main import parse_args, redacted_url; "
              "url = parse_args(sys.argv[1:]).redis_url; print(url); print(redacted_url(url))")
    done = subprocess.run([*entrypoint, sys.executable, "-c", script,
                           *index["command"][1:]], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    password = secret_files["redis-password"].read_text()
    url, redacted = done.stdout.split()
    assert url == f"redis://:{password}@redis:6379/0"
    assert password not in redacted
    assert not any(password in _interpolated(arg) for arg in index["command"])


def test_the_router_takes_api_keys_and_shares_the_tenant_secret_with_engines(
        services, secret_files, host_paths):
    """With the secrets the header makes and the certificates the certs job makes, every
    service's command and TLS environment parse with its real parser: the router reads the API
    key file (pagedgen-keys'), router and engines one tenant secret, each its certificate."""
    from tenancy.salt import read_secret

    script, *argv = services["certs"]["command"]
    assert argv[:2] == ["--out", "/certs"] and script == "pagedgen-certs"
    parsers = {"router": router_args, "engine": engine_args, "engine-gpu1": engine_args,
               "engine-cpu": engine_args, "engine-tp2": engine_args, "prefix-index": index_args}
    secret = read_secret(str(secret_files["tenant-secret"]))
    for name, parse in parsers.items():
        service = services[name]
        env = {k: _on_this_machine(v, host_paths[name])
               for k, v in service["environment"].items()}
        argv = [_on_this_machine(a, host_paths[name]) for a in service["command"][1:]]
        with mock.patch.dict(os.environ, env):
            args = parse(argv)
        assert args.tls is not None, name
        if name == "prefix-index":
            continue
        assert "tenant-secret" in service["secrets"], name
        assert args.tenant_secret == secret, name
    router = router_args([_on_this_machine(a, host_paths["router"])
                          for a in services["router"]["command"][1:]])
    assert services["router"]["secrets"] == ["tenant-secret"]
    assert router.keyring is not None and router.tenant_secret == secret


def test_api_keys_rotate_as_the_header_says(services, host_paths, header_dir):
    """pagedgen-keys writes a new key file (mode 0600) and renames it over the old one. The
    router reads it through a read-only mount of its directory, where the new file shows (a
    single-file mount, as compose secrets are, keeps the old inode), and the header's rotation
    steps leave it readable by the router's uid: after SIGHUP the router holds the new key."""
    router = services["router"]
    assert "api-keys" not in yaml.safe_load(COMPOSE.read_text())["secrets"]
    [key_file] = [a.removeprefix("--api-key-file=") for a in router["command"]
                  if a.startswith("--api-key-file=")]
    [mount] = [m for m in router["volumes"] if isinstance(m, dict) and m["type"] == "bind"
               and key_file.startswith(m["target"] + "/")]
    assert mount["read_only"] is True
    args = router_args([_on_this_machine(a, host_paths["router"]) for a in router["command"][1:]])
    here = args.keyring.path
    assert here.stat().st_mode & 0o004, "the header's first steps leave it readable by all"
    *steps, reload = _header_commands("API keys")
    assert reload.split("#")[0].split() == ["docker", "compose", "kill", "-s", "SIGHUP", "router"]
    inode = here.stat().st_ino
    done = subprocess.run(["bash", "-euc", "\n".join(steps)], cwd=header_dir,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    new_key = done.stdout.split()[0]
    assert here.stat().st_ino != inode  # why the directory is mounted, not the file
    assert here.stat().st_mode & 0o004, "uid 10001 is not the file's owner: others must read"
    assert args.keyring.table.tenant_for(new_key) is None
    assert args.keyring.reload()  # what SIGHUP does
    assert args.keyring.table.tenant_for(new_key).name == "acme"


def test_pagedgen_services_run_on_a_read_only_root_with_a_tmpfs(services):
    """As in Kubernetes (tests/deploy/test_read_only_root.py runs the servers so): every
    service of the image has a read-only root and /tmp in memory; the engines keep their
    caches ($HOME, PAGEDGEN_CACHE_DIR) there, their model volume being read-only, and may
    load what they compile there."""
    ours = {name: s for name, s in services.items() if s.get("image", "").startswith("pagedgen")}
    assert {"certs", "prefix-index", "prepare-model", "router", "engine-cpu"} <= set(ours)
    for name, service in ours.items():
        tmpfs = {path: options.split(",") for path, _, options in
                 (entry.partition(":") for entry in service.get("tmpfs", []))}
        assert service.get("read_only") is True and "/tmp" in tmpfs, name
        if service["command"][0] == "pagedgen-engine":
            env = service["environment"]
            assert env["HOME"] == "/tmp" and env["PAGEDGEN_CACHE_DIR"].startswith("/tmp/"), name
            # Triton loads the launchers it compiles there; Docker's tmpfs is noexec by default.
            assert "exec" in tmpfs["/tmp"], name
