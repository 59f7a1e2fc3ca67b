"""Offline checks of infra/ and workers/ (infra/check.py): YAML, Ray's launcher schema, Kubernetes schemas
and linters when their PyPI tools are installed (skipped otherwise), and cross-file consistency."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("infra_check", ROOT / "infra" / "check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["infra_check"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["check_yaml_parses", "check_ray_launcher", "check_k8s_schemas",
                                  "check_consistency", "check_entrypoint", "check_dockerfile"])
def test_infra_check(check, name):
    res = getattr(check, name)()
    if res.status == "skipped":
        pytest.skip(res.detail)
    assert res.status == "passed", res.detail


def test_launcher_validation_catches_a_typo(check):
    cfg = check.load_docs(ROOT / "infra" / "ray" / "cluster-gpu.yaml")[0]
    assert check.validate_launcher(cfg) is None
    cfg["available_node_types"]["gpu.1x"]["min_wrkers"] = 1
    assert "min_wrkers" in check.validate_launcher(cfg)


def test_pod_templates_of_kuberay_objects(check):
    for name in ("raycluster.yaml", "rayjob.yaml"):
        (doc,) = check.load_docs(ROOT / "infra" / "k8s" / name)
        where = [w for w, _ in check.pod_templates(doc)]
        assert where == ["headGroupSpec", "workerGroupSpecs[gpu]"]
        gpu = check.pod_templates(doc)[1][1]["spec"]["containers"][0]["resources"]["limits"]
        assert gpu["nvidia.com/gpu"] == "1"
