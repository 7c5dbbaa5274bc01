"""The container health probe (`launch --check`) against a server whose certificate names only
its Service's host, as cert-manager issues one (deploy/kubernetes/README.md): the probe dials
localhost, which that certificate does not name, so it checks the role's name (--role)."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from prefix_index.tools.redis_process import free_port
from tests.trust.conftest import files, make_certs
from trust.cli_args import tls_argv

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def service_only_certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("service-only-certs")
    make_certs(out, "--index", "--client", "--host", "prefix-index.pagedgen.svc")
    return out


@pytest.fixture(scope="module")
def index_like_server(service_only_certs):
    """A gRPC server with the standard health service, on the index's certificate."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = free_port()
    credentials = files(service_only_certs, "index").load().server_credentials()
    server.add_secure_port(f"127.0.0.1:{port}", credentials)
    server.start()
    yield f"localhost:{port}"
    server.stop(None)


def check(target: str, certs: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_service.tools.launch", "--check",
                           target, *tls_argv(files(certs, "client")), *extra],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_the_probe_checks_the_role_when_the_certificate_does_not_name_localhost(
        index_like_server, service_only_certs):
    done = check(index_like_server, service_only_certs, "--role", "index")
    assert done.returncode == 0 and done.stdout.strip().endswith("SERVING"), done
    # Without --role the host it dialled must be named, and is not: the probe fails.
    done = check(index_like_server, service_only_certs)
    assert done.returncode == 1 and "UNAVAILABLE" in done.stderr, done


def test_the_probe_refuses_a_server_of_another_role(index_like_server, service_only_certs):
    done = check(index_like_server, service_only_certs, "--role", "engine")
    assert done.returncode == 1 and "UNAVAILABLE" in done.stderr, done


def test_the_probe_names_the_roles_it_knows(index_like_server, service_only_certs):
    done = check(index_like_server, service_only_certs, "--role", "client")
    assert done.returncode == 2 and "--role" in done.stderr and "index" in done.stderr, done
