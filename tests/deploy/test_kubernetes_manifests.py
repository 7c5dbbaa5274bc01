"""deploy/kubernetes renders (base and both overlays) into resources that are valid against the
Kubernetes schemas, run the console scripts with flags their real parsers accept, and agree
with those flags: ports, probes, Services, NetworkPolicies, drain times, the model volume and
the Redis password."""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path
from unittest import mock
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

from engine_service.serving.server import parse_args as engine_args
from engine_service.tools.launch import parse_check_args
from engine_service.tools.prepare_model import parse_args as prepare_model_args
from prefix_index.server.main import parse_args as index_args
from prefix_index.tools.server_options import STOP_AFTER_DRAIN_S
from router.server import parse_args as router_args
from tests.deploy.kustomize_render import RenderError, render, strategic_merge
from tests.deploy.network_paths import ANYWHERE, allowed_paths
from tests.deploy.pods import (
    POD_IP,
    Pod,
    container_env,
    expanded_args,
    on_this_machine,
    pods,
    secret_placeholder,
    selects,
)

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
BUILDS = {"base": KUBE / "base", "cpu": KUBE / "overlays" / "cpu",
          "gpu": KUBE / "overlays" / "gpu"}
# The oldest Kubernetes the manifests claim (README.md) and the newest the schemas know.
KUBERNETES_VERSIONS = ("1.30", latest_version())
PARSERS = {"pagedgen-engine": engine_args, "pagedgen-prefix-index": index_args,
           "pagedgen-router": router_args, "pagedgen-prepare-model": prepare_model_args}
SERVERS = ("pagedgen-engine", "pagedgen-prefix-index", "pagedgen-router")
REDIS_SECRET = ("pagedgen-redis", "password")
API_KEYS_SECRET = "pagedgen-api-keys"
TENANT_SECRET = "pagedgen-tenant-secret"
# The role whose certificate each server's pod mounts (one Secret per role, README.md).
TLS_ROLES = {"pagedgen-engine": "engine", "pagedgen-prefix-index": "index",
             "pagedgen-router": "router"}
MONITORING = 'namespace{"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}'
DNS = ('namespace{"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}} '
       'pods{"matchLabels": {"k8s-app": "kube-dns"}}')


@functools.cache
def _rendered(build: str) -> tuple:
    return tuple(render(BUILDS[build]))


@pytest.fixture(params=sorted(BUILDS))
def resources(request) -> list[dict]:
    return list(_rendered(request.param))


def _by_kind(resources: list[dict], kind: str) -> list[dict]:
    return [r for r in resources if r["kind"] == kind]


def _script(container: dict) -> str | None:
    command = container.get("command") or []
    return command[0] if command and command[0].startswith("pagedgen-") else None


@functools.cache
def _secret_files() -> Path:
    """The Secrets README.md makes, as files (<secret name>/<key>), made the README's way:
    pagedgen-certs per role, a pagedgen-keys key file, a tenant secret."""
    from tenancy.keys_tool import add_key
    from trust.certs_tool import main as make_certs

    root = Path(tempfile.mkdtemp(prefix="pagedgen-secrets-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # keys and certs: not left behind
    certs = root / "certs"
    make_certs(["--out", str(certs), "--engine", "", "--router", "--index", "--client",
                "--host", "localhost"])
    for role in ("engine", "router", "index", "client"):
        secret = root / f"pagedgen-tls-{role}"
        secret.mkdir()
        for key, made in (("tls.crt", f"{role}.pem"), ("tls.key", f"{role}-key.pem"),
                          ("ca.crt", "ca.pem")):
            (secret / key).write_bytes((certs / made).read_bytes())
    (root / API_KEYS_SECRET).mkdir()
    add_key(root / API_KEYS_SECRET / "api-keys.toml", "default")
    (root / TENANT_SECRET).mkdir()
    (root / TENANT_SECRET / "tenant-secret").write_text(secret_placeholder(TENANT_SECRET, "x"))
    return root


def _parse(script: str, pod: Pod, container: dict):
    """The container's args through the script's parser, in the container's environment (the
    servers read some settings, such as $PAGEDGEN_TLS_CERT, from it), with the files its Secret
    volumes mount read from _secret_files()."""
    env = {name: on_this_machine(pod, container, value, _secret_files())
           for name, value in container_env(pod, container).items()}
    argv = [on_this_machine(pod, container, arg, _secret_files())
            for arg in expanded_args(pod, container)]
    with mock.patch.dict(os.environ, env):
        return PARSERS[script](argv)


def _servers(resources: list[dict]) -> dict[str, tuple[Pod, dict, object]]:
    """Console script -> (its pod, its container, its parsed args); one of each."""
    found: dict[str, tuple[Pod, dict, object]] = {}
    for pod in pods(resources):
        for container in pod.spec["containers"]:
            script = _script(container)
            if script in SERVERS:
                assert script not in found, f"{script} runs in two workloads"
                found[script] = (pod, container, _parse(script, pod, container))
    assert set(found) == set(SERVERS), f"workloads found for {sorted(found)}"
    return found


def _workload(resources: list[dict], script: str) -> Pod:
    return _servers(resources)[script][0]


def test_every_resource_is_valid_against_the_kubernetes_schemas(resources):
    errors = []
    for resource in resources:
        for version in KUBERNETES_VERSIONS:
            name = f"{resource['kind']}/{resource['metadata']['name']} (Kubernetes {version})"
            try:
                kubernetes_validate.validate(resource, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                path = ".".join(str(part) for part in error.path)
                errors.append(f"{name}: {path}: {error.message}")
            except SchemaNotFoundError as error:
                errors.append(f"{name}: {error.message}")
    assert not errors, "\n".join(errors)


def test_containers_run_console_scripts_with_flags_their_parsers_accept(resources):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    ran = set()
    for pod in pods(resources):
        for container in pod.containers():
            script = _script(container)
            if not container["image"].startswith("pagedgen:"):
                assert script is None, f"{pod.workload}/{container['name']}: {script} in " \
                                       f"{container['image']}"
                continue
            where = f"{pod.workload}/{container['name']}"
            assert script in scripts, f"{where}: command {container.get('command')} is not a " \
                                      f"console script of pyproject.toml ({sorted(scripts)})"
            try:
                _parse(script, pod, container)
            except SystemExit as exit_:  # argparse names the flag on stderr
                pytest.fail(f"{where}: {script} refuses {expanded_args(pod, container)} "
                            f"(exit {exit_.code})")
            ran.add(script)
    assert ran == set(PARSERS), f"console scripts run: {sorted(ran)}"


def test_a_bad_flag_is_refused_by_the_parser_the_test_calls():
    with pytest.raises(SystemExit):
        engine_args(["--port=50051", "--no-such-flag"])
    with pytest.raises(SystemExit):
        prepare_model_args(["--outt=/models/x"])


def test_container_ports_probes_and_annotations_agree_with_the_flags(resources):
    for script, (pod, container, args) in _servers(resources).items():
        expected = {"grpc": args.port}
        if args.metrics_port:
            expected["metrics"] = args.metrics_port
        if getattr(args, "http_port", 0):
            expected["http"] = args.http_port
        declared = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        assert declared == expected, f"{script}: containerPorts {declared}, flags {expected}"
        assert pod.annotations.get("prometheus.io/port") == str(args.metrics_port), script
        assert "readinessProbe" in container and "livenessProbe" in container, script
        assert "exec" in container["readinessProbe"], script
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            # The kubelet's grpc probe speaks plain text only: against a TLS port it fails.
            assert "grpc" not in probe, f"{script} {kind}: a grpc probe of a TLS port"
            if "exec" in probe:
                check = _probe_check(pod, container, probe)
                assert check.check == f"localhost:{args.port}", f"{script} {kind}"
                assert check.tls is not None and check.tls.ca == args.tls.ca, \
                    f"{script} {kind}: the probe does not speak TLS with the pod's CA"
                # It dials localhost, which a certificate need not name (cert-manager's, in
                # README.md, do not): it checks the server's role name instead.
                assert check.role == TLS_ROLES[script], \
                    f"{script} {kind}: --role {check.role}, the pod serves {TLS_ROLES[script]}"
                assert probe["timeoutSeconds"] >= 5, f"{script} {kind}: python starts slowly"
            else:
                assert pod.resolve_port(probe["tcpSocket"]["port"]) == args.port, \
                    f"{script} {kind}: {probe}"
    engine_pod, engine, _ = _servers(resources)["pagedgen-engine"]
    assert "exec" in engine["livenessProbe"] and "exec" in engine["startupProbe"]


def _probe_check(pod: Pod, container: dict, probe: dict):
    """An exec probe's command through launch --check's own parser (its TLS files read)."""
    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "engine_service.tools.launch"], command
    env = {name: on_this_machine(pod, container, value, _secret_files())
           for name, value in container_env(pod, container).items()}
    with mock.patch.dict(os.environ, env):
        return parse_check_args([on_this_machine(pod, container, arg, _secret_files())
                                 for arg in command[3:]])


def test_every_server_runs_tls_with_its_roles_certificate_from_a_secret(resources):
    """Each server's pod mounts its role's Secret (pagedgen-tls-<role>) read-only and points
    PAGEDGEN_TLS_CERT / _KEY / _CA at it; the real parser loads the three files."""
    from trust.cli_args import TLS_ENV

    for script, (pod, container, args) in _servers(resources).items():
        env = container_env(pod, container)
        paths = {part: env.get(name) for part, name in TLS_ENV.items()}
        assert all(paths.values()), f"{script}: TLS variables {paths}"
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        for part, path in paths.items():
            [mount] = [m for root, m in mounts.items() if path.startswith(root + "/")] or [None]
            assert mount is not None and mount.get("readOnly"), f"{script}: {part} {path}"
            secret = volumes[mount["name"]].get("secret", {}).get("secretName")
            assert secret == f"pagedgen-tls-{TLS_ROLES[script]}", f"{script}: {part} from " \
                                                                   f"{secret}"
        assert args.tls is not None, script


def test_services_select_pods_and_target_their_ports(resources):
    workloads = pods(resources)
    for service in _by_kind(resources, "Service"):
        name = service["metadata"]["name"]
        selected = [p for p in workloads
                    if selects({"matchLabels": service["spec"]["selector"]}, p.labels)]
        assert len(selected) == 1, f"Service {name} selects {[p.workload for p in selected]}"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            number = selected[0].resolve_port(target)
            declared = [p["containerPort"] for p in selected[0].container_ports()]
            assert number in declared, f"Service {name} port {port['port']} targets " \
                                       f"{target!r}, not a containerPort of {selected[0].workload}"


def test_the_router_service_publishes_the_client_ports_and_http_needs_a_key(resources):
    servers = _servers(resources)
    router_pod, _, router = servers["pagedgen-router"]
    http_port = getattr(router, "http_port", 0)
    [service] = [s for s in _by_kind(resources, "Service") if s["metadata"]["name"] == "router"]
    reached = {router_pod.resolve_port(p.get("targetPort", p["port"]))
               for p in service["spec"]["ports"]}
    assert reached == {router.port, *([http_port] if http_port else [])}
    # The front door takes Bearer keys of tenants (gRPC and HTTP), from a Secret's key file.
    assert router.keyring is not None and router.api_key is None
    keys = on_this_machine(router_pod, servers["pagedgen-router"][1], router.api_key_file,
                           _secret_files())
    assert Path(keys).is_relative_to(_secret_files() / API_KEYS_SECRET), router.api_key_file
    # Clients reach the engines only through the router.
    assert not getattr(servers["pagedgen-engine"][2], "http_port", 0)


def test_services_mark_their_tls_ports_as_tls(resources):
    """Every port a server speaks TLS on is published as appProtocol https (HTTP over TLS; gRPC
    is HTTP/2): a mesh or gateway reads appProtocol, or else the port's name ("grpc", "http"),
    to choose what to speak, and cleartext to a TLS port fails. Plain ports do not claim TLS."""
    tls_ports: set[tuple[str, int]] = set()
    for script, (pod, _, args) in _servers(resources).items():
        assert args.tls is not None, script
        tls_ports |= {(pod.workload, port) for port in (args.port, getattr(args, "http_port", 0))
                      if port}
    published = set()
    for service in _by_kind(resources, "Service"):
        [pod] = [p for p in pods(resources)
                 if selects({"matchLabels": service["spec"]["selector"]}, p.labels)]
        for port in service["spec"]["ports"]:
            where = f"Service {service['metadata']['name']} port {port['port']}"
            target = (pod.workload, pod.resolve_port(port.get("targetPort", port["port"])))
            if target in tls_ports:
                assert port.get("appProtocol") == "https", \
                    f"{where}: TLS, but appProtocol {port.get('appProtocol')!r}"
                published.add(target)
            else:
                assert port.get("appProtocol") != "https", f"{where}: plain, but claims TLS"
    assert published == tls_ports, f"TLS ports no Service publishes: {tls_ports - published}"


def _service_target(resources: list[dict], address: str) -> tuple[Pod, int]:
    """host:port of a Service in the namespace -> (the pod it selects, the container port)."""
    host, port = address.rsplit(":", 1)
    [service] = [s for s in _by_kind(resources, "Service") if s["metadata"]["name"] == host] \
        or [None]
    assert service is not None, f"{address}: no Service named {host!r}"
    [entry] = [p for p in service["spec"]["ports"] if p["port"] == int(port)] or [None]
    assert entry is not None, f"{address}: Service {host} has no port {port}"
    [pod] = [p for p in pods(resources)
             if selects({"matchLabels": service["spec"]["selector"]}, p.labels)]
    return pod, pod.resolve_port(entry.get("targetPort", entry["port"]))


def test_addresses_in_the_flags_reach_the_right_servers(resources):
    servers = _servers(resources)
    index_pod, _, index = servers["pagedgen-prefix-index"]
    for script in ("pagedgen-engine", "pagedgen-router"):
        pod, port = _service_target(resources, servers[script][2].prefix_index)
        assert (pod, port) == (index_pod, index.port), f"{script} --prefix-index"
    url = urlsplit(index.redis_url)
    redis_pod, redis_port = _service_target(resources, f"{url.hostname}:{url.port}")
    assert redis_pod.workload == "redis" and redis_port == url.port
    engine_pod, _, engine = servers["pagedgen-engine"]
    # The engine id is the pod name; routers and the index reach the engine at its pod IP.
    assert engine.engine_id == engine_pod.name
    assert engine.advertise_address == f"{POD_IP}:{engine.port}"
    for _, _, args in servers.values():
        assert args.host == "0.0.0.0"


def test_termination_grace_exceeds_the_drain(resources):
    for script, (pod, container, args) in _servers(resources).items():
        pause = 0.0
        pre_stop = container.get("lifecycle", {}).get("preStop")
        if pre_stop is not None:
            command = pre_stop["exec"]["command"]
            assert command[0] == "sleep", f"{script}: preStop {command}"
            pause = float(command[1])
        grace = pod.spec.get("terminationGracePeriodSeconds", 30)
        assert grace > pause + args.grace_s + STOP_AFTER_DRAIN_S, \
            f"{script}: terminationGracePeriodSeconds {grace} <= preStop {pause} + " \
            f"--grace-s {args.grace_s} + the stop after it {STOP_AFTER_DRAIN_S}"


def test_network_policies_allow_only_the_architectures_paths(resources):
    servers = _servers(resources)
    engine, index, router = (servers[s][2] for s in SERVERS)
    redis_port = urlsplit(index.redis_url).port
    # The router's client ports: gRPC, and the OpenAI HTTP API where it serves one. Clients reach
    # engines only through the router, so an engine's HTTP port gets no path.
    front_ports = [router.port, *([router.http_port] if getattr(router, "http_port", 0) else [])]
    [namespace] = _by_kind(resources, "Namespace") or [None]
    labels = {**namespace["metadata"].get("labels", {}),
              "kubernetes.io/metadata.name": namespace["metadata"]["name"]}
    expected = {
        ("router", "engine", f"{engine.port}/TCP"),
        ("router", "prefix-index", f"{index.port}/TCP"),
        ("engine", "prefix-index", f"{index.port}/TCP"),
        ("prefix-index", "engine", f"{engine.port}/TCP"),  # a lease holder's address asked
        ("prefix-index", "redis", f"{redis_port}/TCP"),
        *((ANYWHERE, "router", f"{port}/TCP") for port in front_ports),
        (MONITORING, "engine", f"{engine.metrics_port}/TCP"),
        (MONITORING, "prefix-index", f"{index.metrics_port}/TCP"),
        (MONITORING, "router", f"{router.metrics_port}/TCP"),
        *((workload, DNS, f"53/{protocol}") for workload in ("engine", "prefix-index", "router")
          for protocol in ("UDP", "TCP")),
    }
    policies, workloads = _by_kind(resources, "NetworkPolicy"), pods(resources)
    internal = {p for p in expected if p[0] in ("router", "engine", "prefix-index")
                and p[1] in ("redis", "router", "engine", "prefix-index")}
    sides = {("Ingress", "Egress"): expected,
             # Each side alone as tight as both: the ingress rules admit only the paths' sources
             # on their ports, the egress rules reach only the paths' destinations.
             # (the router's clients come from anywhere, this namespace's pods included)
             ("Ingress",): {p for p in expected if p[1] != DNS}
             | {(w.workload, "router", f"{port}/TCP") for w in workloads for port in front_ports},
             ("Egress",): internal | {p for p in expected if p[1] == DNS}}
    for directions, want in sides.items():
        paths = allowed_paths(policies, workloads, labels, directions)
        assert paths == want, f"{directions}: allowed but not in the architecture: " \
                              f"{paths - want}; in the architecture but denied: {want - paths}"


def test_the_model_volume_is_filled_by_an_init_container_and_mounted_read_only(resources):
    engine_pod, engine_container, engine = _servers(resources)["pagedgen-engine"]
    router_pod = _workload(resources, "pagedgen-router")
    for pod in (engine_pod, router_pod):
        [init] = [c for c in pod.spec.get("initContainers", [])
                  if _script(c) == "pagedgen-prepare-model"]
        out = prepare_model_args(expanded_args(pod, init)).out
        # The router tokenizes locally when the replicas' model directory is at the same path.
        assert str(out) == engine.model, f"{pod.workload}: prepares {out}, engines serve " \
                                         f"{engine.model}"
        [server] = pod.spec["containers"]
        for container, read_only in ((init, False), (server, True)):
            mounts = [m for m in container.get("volumeMounts", [])
                      if out.is_relative_to(m["mountPath"])]
            assert len(mounts) == 1, f"{pod.workload}/{container['name']}: mounts {mounts}"
            assert mounts[0].get("readOnly", False) == read_only, container["name"]
            volume = mounts[0]["name"]
        claims = pod.volume_claim_templates(resources)
        emptied = [v["name"] for v in pod.spec.get("volumes", []) if "emptyDir" in v]
        assert volume in (claims if pod.workload == engine_pod.workload else emptied), \
            f"{pod.workload}: the model volume {volume} (claims {claims}, emptyDirs {emptied})"


def test_the_redis_password_comes_from_one_secret_and_is_not_shipped(resources):
    password = secret_placeholder(*REDIS_SECRET)
    _, _, index = _servers(resources)["pagedgen-prefix-index"]
    assert urlsplit(index.redis_url).password == password
    # ... from the environment (PAGEDGEN_REDIS_URL), not the index's command line.
    [index_pod] = [p for p in pods(resources) if p.workload == "prefix-index"]
    for container in index_pod.containers():
        assert not any(password in arg for arg in expanded_args(index_pod, container))
    [redis] = [p for p in pods(resources) if p.workload == "redis"]
    [container] = redis.spec["containers"]
    args = expanded_args(redis, container)
    assert args[args.index("--requirepass") + 1] == password
    probe_auth = [v for v in container["env"] if v["name"] == "REDISCLI_AUTH"]
    assert probe_auth and probe_auth[0]["valueFrom"]["secretKeyRef"] == dict(
        zip(("name", "key"), REDIS_SECRET, strict=True))
    assert not _by_kind(resources, "Secret"), "secrets are made at install time (README.md)"
    # Bounded, and never evicting a piece of an engine's state (redis.yaml says why).
    assert args[args.index("--maxmemory") + 1] == "512mb"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) * 1024 > 512, limit


def test_router_and_engines_share_one_tenant_secret(resources):
    servers = _servers(resources)
    engine, router = servers["pagedgen-engine"][2], servers["pagedgen-router"][2]
    assert router.tenant_secret is not None and engine.tenant_secret == router.tenant_secret
    for script in ("pagedgen-engine", "pagedgen-router"):
        pod, container, args = servers[script]
        local = on_this_machine(pod, container, args.tenant_secret_file, _secret_files())
        assert Path(local).is_relative_to(_secret_files() / TENANT_SECRET), script


def test_engines_have_a_disruption_budget(resources):
    engine_pod = _workload(resources, "pagedgen-engine")
    [budget] = _by_kind(resources, "PodDisruptionBudget")
    assert selects(budget["spec"]["selector"], engine_pod.labels)
    others = [p.workload for p in pods(resources) if p.workload != engine_pod.workload
              and selects(budget["spec"]["selector"], p.labels)]
    assert not others and budget["spec"]["maxUnavailable"] == 1


def test_every_container_requests_resources(resources):
    for pod in pods(resources):
        for container in pod.containers():
            resources_ = container.get("resources", {})
            where = f"{pod.workload}/{container['name']}"
            assert {"cpu", "memory"} <= set(resources_.get("requests", {})), where
            assert "memory" in resources_.get("limits", {}), where


def test_overlays_place_the_engines():
    def engine(build: str):
        pod, container, args = _servers(list(_rendered(build)))["pagedgen-engine"]
        return pod, container["resources"], args

    pod, resources_, args = engine("gpu")
    assert args.device == "cuda" and resources_["limits"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in pod.spec["tolerations"])
    assert all(c["image"] == "pagedgen:gpu" for c in pod.containers())
    for build in ("base", "cpu"):
        pod, resources_, args = engine(build)
        assert args.device == "cpu" and "nvidia.com/gpu" not in resources_.get("limits", {})
        assert all(c["image"] == "pagedgen:cpu" for c in pod.containers())
    # The engine computes with a thread per CPU of its limit (serving/torch_threads.py reads
    # the cgroup's quota): whole CPUs, requested as limited, and no count of its own.
    _, resources_, args = engine("cpu")
    assert resources_["requests"]["cpu"] == resources_["limits"]["cpu"]
    assert int(resources_["limits"]["cpu"]) >= 1 and args.torch_threads is None


# What minikube's own pods request on its node, beside ours: the API server (250m), controller
# manager (200m), scheduler (100m), etcd (100m, 100 MiB), CoreDNS (100m, 70 MiB) and Calico's
# node agent (250m), which README.md's --cni=calico adds.
MINIKUBE_SYSTEM_CPUS = 1.0
MINIKUBE_SYSTEM_GIB = 0.25


def _quantity(value: str | int) -> float:
    """A Kubernetes CPU or memory quantity as a number (CPUs, bytes)."""
    text = str(value)
    for suffix, scale in (("m", 1e-3), ("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30),
                          ("Ti", 2**40)):
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * scale
    return float(text)


def _pod_requests(pod: Pod) -> dict[str, float]:
    """What the scheduler reserves for one pod: its containers' requests together, or its
    largest initContainer's where that is more (they run one at a time, before the rest)."""
    assert not any(c.get("restartPolicy") for c in pod.spec.get("initContainers", [])), \
        f"{pod.workload}: sidecar initContainers are counted differently"

    def requests(container: dict, name: str) -> float:
        return _quantity(container.get("resources", {}).get("requests", {}).get(name, 0))

    return {name: max([sum(requests(c, name) for c in pod.spec["containers"]),
                       *(requests(c, name) for c in pod.spec.get("initContainers", []))])
            for name in ("cpu", "memory")}


def test_the_readme_states_what_the_cpu_overlay_requests():
    """README.md's totals for the cpu overlay are what its pods request (replicas included), and
    the minikube node it says to start has room for them beside minikube's own pods."""
    resources = list(_rendered("cpu"))
    replicas = {(r["kind"], r["metadata"]["name"]): r["spec"].get("replicas", 1)
                for r in resources if r["kind"] in ("Deployment", "StatefulSet")}
    cpus = gib = 0.0
    for pod in pods(resources):
        count = replicas[(pod.kind, pod.workload)]
        requested = _pod_requests(pod)
        cpus += count * requested["cpu"]
        gib += count * requested["memory"] / 2**30
    text = " ".join((KUBE / "README.md").read_text().split())
    stated = re.search(r"cpu overlay's pods request ([\d.]+) CPUs and ([\d.]+) GiB", text)
    assert stated, "README.md does not state the cpu overlay's requests"
    assert (float(stated[1]), float(stated[2])) == (round(cpus, 2), round(gib, 2)), \
        f"README.md states {stated[1]} CPUs and {stated[2]} GiB; the pods request " \
        f"{cpus:.2f} CPUs and {gib:.2f} GiB"
    start = re.search(r"minikube start --cpus=(\d+) --memory=(\d+)g\b", text)
    assert start, "README.md does not say how to start a minikube node with room"
    assert int(start[1]) >= cpus + MINIKUBE_SYSTEM_CPUS, start[0]
    assert int(start[2]) >= gib + MINIKUBE_SYSTEM_GIB, start[0]


def test_the_renderer_merges_as_kustomize_does():
    pod = {"containers": [{"name": "a", "args": ["--x"], "env": [{"name": "A", "value": "1"}]},
                          {"name": "b", "ports": [{"containerPort": 1}]}],
           "tolerations": [{"key": "k"}]}
    patch = {"containers": [{"name": "b", "ports": [{"containerPort": 2}]},
                            {"name": "a", "args": ["--y"], "env": [{"name": "B", "value": "2"}]}],
             "tolerations": [{"key": "t"}]}
    assert strategic_merge(pod, patch) == {
        "containers": [{"name": "a", "args": ["--y"],
                        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
                       {"name": "b", "ports": [{"containerPort": 1}, {"containerPort": 2}]}],
        "tolerations": [{"key": "t"}]}
    with pytest.raises(RenderError, match=r"\$patch"):
        strategic_merge(pod, {"containers": [{"name": "a", "$patch": "delete"}]})


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_the_renderer_agrees_with_kustomize(build):
    command = _kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed: the renderer is checked "
                    "against them where they are")
    done = subprocess.run([*command, str(BUILDS[build])], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr

    def keyed(items) -> dict:
        return {(r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"]): r
                for r in items}

    theirs = keyed(doc for doc in yaml.safe_load_all(done.stdout) if doc)
    assert keyed(_rendered(build)) == theirs


def test_every_pagedgen_container_has_a_read_only_root_and_a_writable_tmp(resources):
    """readOnlyRootFilesystem on every container of the image (its servers and the model's
    preparation), each with an emptyDir at /tmp, where they write (tests/deploy/
    test_read_only_root.py runs them so); the engine's caches and $HOME there too."""
    seen = set()
    for pod in pods(resources):
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for container in pod.containers():
            script = _script(container)
            if script is None:
                continue
            seen.add(script)
            where = f"{pod.workload}/{container['name']}"
            assert container["securityContext"].get("readOnlyRootFilesystem") is True, where
            tmp = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
            assert len(tmp) == 1 and not tmp[0].get("readOnly"), where
            assert "emptyDir" in volumes[tmp[0]["name"]], where
            if script == "pagedgen-engine":
                env = container_env(pod, container)
                assert env.get("HOME") == "/tmp", where
                assert env.get("PAGEDGEN_CACHE_DIR", "").startswith("/tmp/"), where
    assert seen == {*SERVERS, "pagedgen-prepare-model"}
