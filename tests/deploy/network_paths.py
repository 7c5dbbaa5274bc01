"""The connections that a namespace's NetworkPolicies allow, as a set of paths.

A path is (source, destination, "PORT/PROTOCOL"). Sources and destinations in the namespace are
workload names; peers outside it are described by their selectors ("anywhere" for a rule with
no peers, "namespace{...}" or "namespace{...} pods{...}" for selectors, "ip{...}" for a CIDR).
A connection inside the namespace needs both ends: the destination's ingress rules and the
source's egress rules. A pod that no policy of a direction selects is open in that direction:
it gets the path (ANYWHERE, pod, "*") or (pod, ANYWHERE, "*"). A rule that opens every port of
a destination gives a path to "other/TCP" (and UDP, SCTP) beside its containerPorts.
"""

from __future__ import annotations

import json

from tests.deploy.pods import Pod, selects

ANYWHERE = "anywhere"
OTHER_PORT = "other"
Path = tuple[str, str, str]


def allowed_paths(policies: list[dict], pods: list[Pod], namespace_labels: dict,
                  directions: tuple[str, ...] = ("Ingress", "Egress")) -> set[Path]:
    """The paths the policies of `directions` allow: with both, what connects; with one, what
    that side's policies alone would let through (each side should be as tight as the pair)."""
    paths: set[Path] = set()
    for pod in pods:
        for direction in directions:
            rules = _rules(policies, pod, direction)
            if rules is None:
                paths.add((ANYWHERE, pod.workload, "*") if direction == "Ingress"
                          else (pod.workload, ANYWHERE, "*"))
                continue
            for rule in rules:
                paths |= _outside_paths(pod, rule, direction)
    for source in pods:
        egress = _rules(policies, source, "Egress") if "Egress" in directions else None
        for destination in pods:
            ingress = _rules(policies, destination, "Ingress") if "Ingress" in directions \
                else None
            for port in _pod_ports(destination):
                if (_allows(ingress, "from", destination, source, destination, port,
                            namespace_labels)
                        and _allows(egress, "to", source, destination, destination, port,
                                    namespace_labels)):
                    paths.add((source.workload, destination.workload, port))
    return paths


def _policy_types(policy: dict) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def _rules(policies: list[dict], pod: Pod, direction: str) -> list[dict] | None:
    """The rules of every policy that selects pod for direction; None when none selects it."""
    selecting = [p for p in policies
                 if p["metadata"].get("namespace", "default") == pod.namespace
                 and direction in _policy_types(p) and selects(p["spec"]["podSelector"],
                                                               pod.labels)]
    if not selecting:
        return None
    return [rule for p in selecting for rule in p["spec"].get(direction.lower(), [])]


def _pod_ports(pod: Pod) -> list[str]:
    """The pod's containerPorts, and any other port of each protocol: a rule that opens every
    port shows up as a path to OTHER_PORT (nothing may listen there today, but that is luck)."""
    declared = {f"{p['containerPort']}/{p.get('protocol', 'TCP')}" for p in pod.container_ports()}
    return sorted(declared | {f"{OTHER_PORT}/{protocol}" for protocol in ("TCP", "UDP", "SCTP")})


def _port_matches(rule: dict, port: str, destination: Pod) -> bool:
    if not rule.get("ports"):
        return True
    number, protocol = port.split("/")
    for entry in rule["ports"]:
        if entry.get("protocol", "TCP") != protocol:
            continue
        if "port" not in entry:
            return True
        if number == OTHER_PORT:
            continue
        first = destination.resolve_port(entry["port"])
        if first is not None and first <= int(number) <= entry.get("endPort", first):
            return True
    return False


def _peer_selects(peer: dict, policy_pod: Pod, other: Pod, namespace_labels: dict) -> bool:
    """Whether peer (of a rule of a policy in policy_pod's namespace) selects the pod other."""
    if "ipBlock" in peer:
        return False  # pod IPs are not modelled; ipBlock peers count as outside
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], namespace_labels):
            return False
    elif other.namespace != policy_pod.namespace:
        return False
    return selects(peer.get("podSelector", {}), other.labels)


def _allows(rules: list[dict] | None, key: str, policy_pod: Pod, other: Pod, destination: Pod,
            port: str, namespace_labels: dict) -> bool:
    """Whether rules (the `key` side: "from" or "to") let policy_pod talk with other."""
    if rules is None:
        return True
    for rule in rules:
        peers = rule.get(key) or [{}]
        if any(_peer_selects(peer, policy_pod, other, namespace_labels) for peer in peers) \
                and _port_matches(rule, port, destination):
            return True
    return False


def _describe(peer: dict) -> str:
    if not peer:
        return ANYWHERE
    if "ipBlock" in peer:
        return f"ip{json.dumps(peer['ipBlock'], sort_keys=True)}"
    parts = []
    if "namespaceSelector" in peer:
        parts.append(f"namespace{json.dumps(peer['namespaceSelector'], sort_keys=True)}")
    if "podSelector" in peer:
        parts.append(f"pods{json.dumps(peer['podSelector'], sort_keys=True)}")
    return " ".join(parts)


def _outside_paths(pod: Pod, rule: dict, direction: str) -> set[Path]:
    """The paths a rule opens to peers outside the namespace (or to anything, for no peers).
    Ports are resolved on pod for ingress; egress ports to outside are taken as written."""
    key = "from" if direction == "Ingress" else "to"
    peers = [peer for peer in rule.get(key) or [{}]
             if not peer or "ipBlock" in peer or "namespaceSelector" in peer]
    if direction == "Ingress":
        ports = [p for p in _pod_ports(pod) if _port_matches(rule, p, pod)]
    else:
        ports = [f"{p.get('port', '*')}/{p.get('protocol', 'TCP')}"
                 for p in rule.get("ports", [])] or ["*"]
    return {(_describe(peer), pod.workload, port) if direction == "Ingress"
            else (pod.workload, _describe(peer), port)
            for peer in peers for port in ports}
