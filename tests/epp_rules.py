"""The Endpoint Picker's metric extraction rules, applied to a Prometheus text answer (test helper).

Mirrors llm-d-router's ``core-metrics-extractor`` (``pkg/epp/framework/plugins/datalayer/extractor/metrics``:
``extractor.go``, ``spec.go``, ``loraspec.go``) for the default ``vllm`` engine mapping of the Model Server
Protocol (gateway-api-inference-extension ``docs/proposals/003-model-server-protocol``):

- a family is looked up by exact name; a missing family or one without series is an extraction error;
- among the matching series the one with the latest timestamp wins; text exposition has no timestamps, so the
  first series wins (``ts > recent`` with every ts 0): several series are *not* summed;
- the value is read only from a gauge or a counter (any other type gives 0); queue and running are truncated to
  int;
- ``vllm:lora_requests_info``: the series with the highest value wins; labels ``running_lora_adapters`` /
  ``waiting_lora_adapters`` are comma lists, ``max_lora`` an int when non-empty; a missing family is no error;
- ``vllm:cache_config_info``: labels ``block_size`` and ``num_gpu_blocks`` parsed as ints when non-empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

QUEUE, RUNNING, KV, LORA, CACHE = ("vllm:num_requests_waiting", "vllm:num_requests_running",
                                   "vllm:kv_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info")


@dataclass
class EndpointMetrics:
    """What the EPP stores for one endpoint after one scrape; ``errors``: the extraction errors it would log."""

    waiting_queue_size: int = 0
    running_requests_size: int = 0
    kv_cache_usage_percent: float = 0.0
    active_models: dict[str, int] = field(default_factory=dict)
    waiting_models: dict[str, int] = field(default_factory=dict)
    max_active_models: int = 0
    cache_block_size: int = 0
    cache_num_blocks: int = 0
    errors: list[str] = field(default_factory=list)
    series: dict[str, int] = field(default_factory=dict)  # family → how many series it had


def _families(text: str) -> dict[str, tuple[str, list[tuple[dict[str, str], float]]]]:
    out: dict[str, tuple[str, list[tuple[dict[str, str], float]]]] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = (fam.type, [(dict(s.labels), s.value) for s in fam.samples])
    return out


def _value(kind: str, v: float) -> float:
    return v if kind in ("gauge", "counter") else 0.0


def extract(text: str) -> EndpointMetrics:
    """Apply the rules (module docstring) to a ``/metrics`` answer."""
    fams = _families(text)
    m = EndpointMetrics(series={n: len(fams[n][1]) for n in (QUEUE, RUNNING, KV, LORA, CACHE) if n in fams})

    def latest(name: str) -> tuple[str, dict[str, str], float] | None:
        if name not in fams or not fams[name][1]:
            m.errors.append(f"metric family {name!r} not found")
            return None
        kind, samples = fams[name]
        labels, v = samples[0]  # every timestamp is 0 in text exposition: the first wins
        return kind, labels, v

    if (r := latest(QUEUE)) is not None:
        m.waiting_queue_size = int(_value(r[0], r[2]))
    if (r := latest(RUNNING)) is not None:
        m.running_requests_size = int(_value(r[0], r[2]))
    if (r := latest(KV)) is not None:
        m.kv_cache_usage_percent = _value(r[0], r[2])
    if LORA in fams and fams[LORA][1]:
        kind, samples = fams[LORA]
        labels, _ = max(samples, key=lambda s: _value(kind, s[1]))
        for key, target in (("running_lora_adapters", m.active_models), ("waiting_lora_adapters", m.waiting_models)):
            for name in labels.get(key, "").split(","):
                if name.strip():
                    target[name.strip()] = 0
        if labels.get("max_lora"):
            m.max_active_models = int(labels["max_lora"])
    if (r := latest(CACHE)) is not None:
        if r[1].get("block_size"):
            m.cache_block_size = int(r[1]["block_size"])
        if r[1].get("num_gpu_blocks"):
            m.cache_num_blocks = int(r[1]["num_gpu_blocks"])
    return m


def picker_filter(endpoints: dict[str, EndpointMetrics], queue_threshold: int = 5, kv_threshold: float = 0.8,
                  headroom: float = 0.0) -> list[str]:
    """llm-d-router's ``utilization-detector`` as a scheduling filter (``plugins/flowcontrol/saturationdetector/
    utilization/detector.go``, ``Filter``): an endpoint stays a candidate only with waiting < ``queue_threshold`` ×
    (1 + ``headroom``) and KV usage < ``kv_threshold`` × (1 + ``headroom``); when none would stay, all do (fail
    open). Defaults: the plugin's (``queueDepthThreshold`` 5, ``kvCacheUtilThreshold`` 0.8, ``headroom`` 0)."""
    q_limit, kv_limit = queue_threshold * (1 + headroom), kv_threshold * (1 + headroom)
    kept = [name for name, m in endpoints.items()
            if m.waiting_queue_size < q_limit and m.kv_cache_usage_percent < kv_limit]
    return kept or list(endpoints)


def picker_scores(endpoints: dict[str, EndpointMetrics]) -> dict[str, float]:
    """The shipped ``endpoint-picker-config.yaml`` profile's score per endpoint: ``queue-scorer`` (waiting, min-max
    normalised: the shortest queue 1, the longest 0, all equal 1; ``scorer/queuedepth/queue.go``) plus
    ``kv-cache-utilization-scorer`` (1 − KV usage), weight 1 each; ``max-score-picker`` takes the highest."""
    waits = [m.waiting_queue_size for m in endpoints.values()]
    lo, hi = min(waits), max(waits)
    return {name: (1.0 if hi == lo else (hi - m.waiting_queue_size) / (hi - lo)) + 1 - m.kv_cache_usage_percent
            for name, m in endpoints.items()}
