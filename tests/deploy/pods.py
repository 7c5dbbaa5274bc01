"""The pods that rendered Kubernetes manifests would run: each workload's pod template, its
containers' ports, and their args as the kubelet expands them."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
# What the downward API gives the fields these manifests read (a pod of a replica's name).
POD_IP = "10.1.2.3"
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


@dataclass(frozen=True)
class Pod:
    """One workload's pod template."""

    workload: str  # the Deployment's / StatefulSet's name
    kind: str
    namespace: str
    labels: dict
    annotations: dict
    spec: dict

    @property
    def name(self) -> str:
        """The name of the first replica's pod (a StatefulSet's ordinal 0)."""
        return f"{self.workload}-0"

    def containers(self, init: bool = True) -> list[dict]:
        init_containers = self.spec.get("initContainers", []) if init else []
        return [*init_containers, *self.spec["containers"]]

    def container_ports(self) -> list[dict]:
        return [port for c in self.spec["containers"] for port in c.get("ports", [])]

    def resolve_port(self, port: int | str) -> int | None:
        """A number, or a named containerPort's number (None when no container has it)."""
        if isinstance(port, int):
            return port
        return next((p["containerPort"] for p in self.container_ports()
                     if p.get("name") == port), None)

    def volume_claim_templates(self, resources: list[dict]) -> list[str]:
        workload = next(r for r in resources
                        if r["kind"] == self.kind and r["metadata"]["name"] == self.workload)
        return [t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])]


def pods(resources: list[dict]) -> list[Pod]:
    found = []
    for resource in resources:
        if resource["kind"] not in WORKLOAD_KINDS:
            continue
        template = resource["spec"]["template"]
        metadata = template.get("metadata", {})
        found.append(Pod(resource["metadata"]["name"], resource["kind"],
                         resource["metadata"].get("namespace", "default"),
                         metadata.get("labels", {}), metadata.get("annotations", {}),
                         template["spec"]))
    return found


def secret_placeholder(name: str, key: str) -> str:
    """A stand-in for the value of a Secret's key: hex, like the README's generated ones, and
    the same wherever that key is referenced."""
    return hashlib.sha256(f"{name}/{key}".encode()).hexdigest()[:32]


def container_env(pod: Pod, container: dict) -> dict[str, str]:
    """The container's environment as the kubelet sets it (valueFrom resolved with stand-ins);
    a reference it cannot resolve raises ValueError naming the variable."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env, f"env {var['name']}")
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            values = {"metadata.name": pod.name, "metadata.namespace": pod.namespace,
                      "status.podIP": POD_IP}
            if field not in values:
                raise ValueError(f"{pod.workload}/{container['name']}: env {var['name']}: "
                                 f"fieldRef {field!r} is not modelled by this test")
            env[var["name"]] = values[field]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = secret_placeholder(ref["name"], ref["key"])
        else:
            raise ValueError(f"{pod.workload}/{container['name']}: env {var['name']}: "
                             f"valueFrom {sorted(source)} is not modelled by this test")
    return env


def expand(text: str, env: dict[str, str], where: str) -> str:
    """Kubernetes' $(VAR) expansion ($$ escapes). Kubernetes leaves an unknown $(VAR) as it is;
    here it is an error, since it is always a typo in these manifests."""

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        if name not in env:
            raise ValueError(f"{where}: $({name}) is not a variable of the container "
                             f"(defined: {sorted(env)})")
        return env[name]

    return _REFERENCE.sub(replace, text)


def expanded_args(pod: Pod, container: dict) -> list[str]:
    env = container_env(pod, container)
    return [expand(arg, env, f"{pod.workload}/{container['name']} args")
            for arg in container.get("args", [])]


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against labels; {} selects everything."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"selector operator {operator!r} is not a Kubernetes one")
    return True


def on_this_machine(pod: Pod, container: dict, text: str, secrets_root) -> str:
    """`text` with a path under one of the container's Secret volume mounts turned into the file
    <secrets_root>/<secret name>/<key> (where a test keeps stand-ins of the Secrets' files)."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        secret = volumes.get(mount["name"], {}).get("secret")
        root = mount["mountPath"].rstrip("/") + "/"
        if secret is not None and root in text:
            text = text.replace(root, f"{secrets_root}/{secret['secretName']}/")
    return text
