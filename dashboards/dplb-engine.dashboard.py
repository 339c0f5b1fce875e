"""DPLB engine: the vLLM (or sim) engine's own vllm:* metrics per worker, from the workers' metrics ports.
→ dplb-engine.json"""

from _common import WORKERS, Layout, engine, make_dashboard, rate, targets, ts

RUN, WAIT, KV = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
TTFT, E2E = "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket"
QUEUE = "vllm:request_queue_time_seconds_bucket"
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
PROMPT, GEN = "vllm:prompt_tokens_total", "vllm:generation_tokens_total"
W = f"{{{WORKERS}}}"


def q(quant: float, bucket: str, by: str = "") -> str:
    """histogram_quantile over an engine histogram, per worker when ``by`` is given."""
    group = f"{by}, le" if by else "le"
    return f"histogram_quantile({quant}, {engine(rate(bucket + W), f'sum by ({group})')})"


L = Layout()
L.row("Scheduler").add(
    ts("Requests running per worker", "none", targets((engine(RUN + W), "worker {{worker}}")),
       "Sequences in the engine's running batch (vllm:num_requests_running)."),
    ts("Requests waiting per worker", "none", targets((engine(WAIT + W), "worker {{worker}}")),
       "Sequences waiting for a batch slot or KV blocks (vllm:num_requests_waiting)."),
    ts("Engine KV-cache usage per worker", "percentunit", targets((engine(KV + W, "max by (worker)"),
                                                                    "worker {{worker}}")),
       "vllm:kv_cache_usage_perc (1 = full): the engine's own view of what the router's memory term uses.",
       valueMin=0, valueMax=1),
    ts("Prefix cache hit rate per worker", "percentunit",
       targets((f"{engine(rate(HITS + W))} / {engine(rate(QUERIES + W))}", "worker {{worker}}")),
       "Prompt tokens served from the prefix cache / prompt tokens queried. Prefix affinity keeps it high.",
       valueMin=0, valueMax=1),
)
L.row("Latency").add(
    ts("Engine time to first token P50 / P95 / P99", "s",
       targets(*[(q(x, TTFT), f"P{round(x * 100)}") for x in (0.5, 0.95, 0.99)]),
       "vllm:time_to_first_token_seconds over the selected workers (arrival in the engine to first token)."),
    ts("Engine E2E latency P50 / P95 / P99", "s",
       targets(*[(q(x, E2E), f"P{round(x * 100)}") for x in (0.5, 0.95, 0.99)]),
       "vllm:e2e_request_latency_seconds over the selected workers."),
    ts("Engine time to first token P95 per worker", "s", targets((q(0.95, TTFT, "worker"), "worker {{worker}}")),
       "A worker whose TTFT climbs has a queue or a long prefill."),
    ts("Engine E2E latency P95 per worker", "s", targets((q(0.95, E2E, "worker"), "worker {{worker}}")),
       "Per-worker engine latency; compare with the router's view in the overview dashboard."),
    ts("Engine queue time P95 per worker", "s", targets((q(0.95, QUEUE, "worker"), "worker {{worker}}")),
       "Time sequences spend waiting before they are scheduled (vllm:request_queue_time_seconds)."),
    ts("Tokens/s per worker", "short",
       targets((engine(rate(PROMPT + W)), "prompt {{worker}}"), (engine(rate(GEN + W)), "generated {{worker}}")),
       "Prompt (prefill) and generated tokens per second."),
)

dashboard = make_dashboard(
    "DPLB engine (vLLM) per worker", "dplb-engine",
    "The engine's vllm:* metrics of each DPLB worker (scraped from the workers' metrics ports, job dplb-workers), "
    "joined with their worker id. Generated from dashboards/dplb-engine.dashboard.py; do not edit the JSON.", L)
