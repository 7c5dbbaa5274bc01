"""A small Kustomize renderer for the tests of deploy/kubernetes (no kubectl or kustomize needed).

It renders the subset of Kustomize those files use, as Kustomize does, and refuses the rest by
name (a kustomization field, a patch directive or a JSON patch op it does not know), so a new
feature in the manifests fails the test instead of rendering wrongly:

- `resources`: YAML files (one or more documents) and directories holding a kustomization;
- `namespace`: set on every namespaced resource;
- `patches`: a strategic merge patch (a file or inline; its target is its own kind and name,
  or `target`) and JSON 6902 patches (`add`, `replace`, `remove`, inline with a `target`).

Strategic merge: maps merge key by key, null deletes a key, lists of scalars are replaced, and
lists of objects merge by the field Kubernetes declares as their merge key (below) or are
replaced when it declares none. test_kubernetes_manifests.py checks this renderer against
`kustomize build` wherever kustomize (or kubectl) is installed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "namespace", "patches"}
PATCH_FIELDS = {"path", "patch", "target"}
TARGET_FIELDS = {"kind", "name"}
CLUSTER_SCOPED_KINDS = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole",
                        "ClusterRoleBinding", "CustomResourceDefinition", "PriorityClass"}
# The patchMergeKey of the Kubernetes list fields these manifests patch (core/v1 types). A list
# of objects under any other field is replaced whole, as Kustomize does for a list without one.
MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "imagePullSecrets": ("name",),
    # Container ports merge by containerPort, Service ports by port.
    "ports": ("containerPort", "port"),
}


class RenderError(ValueError):
    """A kustomization this renderer cannot render faithfully, or one Kustomize would refuse."""


def render(directory: Path) -> list[dict]:
    """The resources `kustomize build directory` outputs (in the order they were read)."""
    directory = Path(directory)
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise RenderError(f"{directory}: no kustomization.yaml")
    kustomization = yaml.safe_load(path.read_text()) or {}
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    if unknown:
        raise RenderError(f"{path}: fields {sorted(unknown)} are not supported by this renderer "
                          f"(supported: {sorted(KUSTOMIZATION_FIELDS)})")
    resources: list[dict] = []
    for entry in kustomization.get("resources", []):
        source = (directory / entry).resolve()
        resources.extend(render(source) if source.is_dir() else _load_documents(source))
    for patch in kustomization.get("patches", []):
        _apply_patch(resources, patch, directory)
    namespace = kustomization.get("namespace")
    if namespace is not None:
        for resource in resources:
            if resource["kind"] == "Namespace":
                if resource["metadata"]["name"] != namespace:
                    raise RenderError(f"{path}: Namespace {resource['metadata']['name']!r} "
                                      f"differs from namespace {namespace!r}")
            elif resource["kind"] not in CLUSTER_SCOPED_KINDS:
                resource["metadata"]["namespace"] = namespace
    return resources


def _load_documents(path: Path) -> list[dict]:
    if not path.is_file():
        raise RenderError(f"resource {path} does not exist")
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _apply_patch(resources: list[dict], entry: dict, directory: Path) -> None:
    unknown = set(entry) - PATCH_FIELDS
    if unknown or ("path" in entry) == ("patch" in entry):
        raise RenderError(f"{directory}: a patch needs one of path / patch, and only "
                          f"{sorted(PATCH_FIELDS)}; got {sorted(entry)}")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    body = yaml.safe_load(text)
    target = entry.get("target")
    if target is not None and set(target) - TARGET_FIELDS:
        raise RenderError(f"{directory}: patch target fields {sorted(set(target))} are not "
                          f"supported (supported: {sorted(TARGET_FIELDS)})")
    if isinstance(body, list):  # JSON 6902
        if target is None:
            raise RenderError(f"{directory}: a JSON 6902 patch needs a target")
        for resource in _targets(resources, target, directory):
            for op in body:
                _json_patch_op(resource, op)
        return
    if not isinstance(body, dict):
        raise RenderError(f"{directory}: a patch must be a map or a list of ops, got {body!r}")
    selector = target or {"kind": body.get("kind"), "name": body.get("metadata", {}).get("name")}
    for resource in _targets(resources, selector, directory):
        merged = strategic_merge(resource, body)
        resource.clear()
        resource.update(merged)


def _targets(resources: list[dict], target: dict, directory: Path) -> list[dict]:
    found = [r for r in resources
             if all(r["kind"] == target["kind"] if key == "kind" else
                    r["metadata"]["name"] == target["name"] for key in target)]
    if not found:
        raise RenderError(f"{directory}: no resource matches the patch target {target}")
    return found


def strategic_merge(original: Any, patch: Any, field: str = "") -> Any:
    """original with patch merged in (neither is changed)."""
    if isinstance(patch, dict):
        for key in patch:
            if isinstance(key, str) and key.startswith("$"):
                raise RenderError(f"patch directive {key!r} is not supported by this renderer")
        if not isinstance(original, dict):
            return copy.deepcopy(patch)
        merged = copy.deepcopy(original)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if isinstance(patch, list) and isinstance(original, list) and field in MERGE_KEYS \
            and all(isinstance(item, dict) for item in patch + original):
        key = next((k for k in MERGE_KEYS[field] if any(k in item for item in patch + original)),
                   None)
        if key is None:
            raise RenderError(f"list {field!r}: no item has its merge key {MERGE_KEYS[field]}")
        merged = copy.deepcopy(original)
        for item in patch:
            if key not in item:
                raise RenderError(f"list {field!r}: patch item {item} lacks its merge key {key!r}")
            match = next((i for i, old in enumerate(merged) if old.get(key) == item[key]), None)
            if match is None:
                merged.append(copy.deepcopy(item))
            else:
                merged[match] = strategic_merge(merged[match], item, field)
        return merged
    return copy.deepcopy(patch)


def _json_patch_op(resource: dict, op: dict) -> None:
    kind, path = op.get("op"), op.get("path", "")
    if kind not in ("add", "replace", "remove"):
        raise RenderError(f"JSON patch op {kind!r} is not supported (add, replace, remove)")
    if not path.startswith("/"):
        raise RenderError(f"JSON patch path {path!r} must start with /")
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]
    node: Any = resource
    try:
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
    except (KeyError, IndexError, ValueError, TypeError) as error:
        raise RenderError(f"JSON patch {kind} of {path}: {part!r} is not there") from error
    if isinstance(node, list):
        if kind == "add":
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
        elif kind == "replace":
            node[int(last)] = copy.deepcopy(op["value"])
        else:
            del node[int(last)]
        return
    if kind != "add" and last not in node:
        raise RenderError(f"JSON patch {kind} of {path}: nothing there")
    if kind == "remove":
        del node[last]
    else:
        node[last] = copy.deepcopy(op["value"])
