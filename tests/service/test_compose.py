"""compose.yaml is valid against the Compose spec and wires the stack the way DESIGN.md says."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from engine_service.serving.server import parse_args as engine_args
from prefix_index.server.main import parse_args as index_args
from router.server import parse_args as router_args

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_compose_matches_the_compose_spec():
    binary = shutil.which("check-jsonschema")
    assert binary, "check-jsonschema is not installed (pip install check-jsonschema)"
    done = subprocess.run([binary, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dependencies_healthchecks_and_gpu(services):
    assert services["redis"]["healthcheck"]["test"][-1] == "ping"
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


def test_commands_parse_with_the_real_console_scripts(services):
    """The flags in compose.yaml are ones the servers accept (argparse exits on a bad one)."""
    for name in ("engine", "engine-cpu"):
        script, *argv = services[name]["command"]
        assert script == "pagedgen-engine"
        args = engine_args(argv)
        assert args.prefix_index == "prefix-index:50061" and args.port == 50051
    script, *argv = services["prefix-index"]["command"]
    assert script == "pagedgen-prefix-index"
    assert index_args(argv).redis_url == "redis://redis:6379/0"
    script, *argv = services["router"]["command"]
    assert script == "pagedgen-router"
    args = router_args(argv)
    assert args.prefix_index == "prefix-index:50061" and args.engine_list == []
    assert args.policy == "kv-aware" and args.port == 50051


def test_the_router_fronts_scalable_engine_replicas(services):
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
        args = engine_args(engine["command"][1:])
        assert args.engine_id is None and args.advertise_address == "" and args.host == "0.0.0.0"
    assert services["engine-cpu"]["deploy"]["replicas"] >= 2


def test_healthcheck_probe_reports_serving(engine_server):
    done = subprocess.run(["python", "-m", "engine_service.tools.launch", "--check",
                           engine_server.target], capture_output=True, text=True, timeout=30,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("SERVING"), done


def test_every_service_runs_tls_with_certificates_from_the_certs_job(services):
    """The `certs` job's command is one pagedgen-certs accepts; the index, the engines and the
    router read their own certificate from the volume it fills (issue 32)."""
    from trust.certs_tool import parse_args as certs_args

    script, *argv = services["certs"]["command"]
    assert script == "pagedgen-certs"
    made = certs_args(argv)
    assert made.router and made.index and made.engine == [""]
    assert {"localhost", "router", "prefix-index"} <= set(made.host)
    for name, stem in (("prefix-index", "index"), ("engine", "engine"), ("engine-cpu", "engine"),
                       ("router", "router")):
        env = services[name]["environment"]
        assert env == {"PAGEDGEN_TLS_CERT": f"/certs/{stem}.pem",
                       "PAGEDGEN_TLS_KEY": f"/certs/{stem}-key.pem",
                       "PAGEDGEN_TLS_CA": "/certs/ca.pem"}, name
        assert "pagedgen-certs:/certs:ro" in services[name]["volumes"], name
    assert services["prefix-index"]["depends_on"]["certs"] == {
        "condition": "service_completed_successfully"}
