"""DPLB routing and workers: every scoring input per worker as the scorer saw it, lifecycle figures, OOMs, and the
cost of deciding. → dplb-routing.json"""

from _common import (
    ROUTER,
    SEL_W,
    WORKERS,
    Layout,
    engine,
    lifecycle_timeline,
    make_dashboard,
    quantile,
    r,
    rate,
    targets,
    ts,
)

from dplb.obs import metrics as M

TERM_DOC = {
    "queue": "1 − queue / max_queue, past max_queue 1 − queue / the longest queue: falls as requests pile up on the "
             "worker (weights: dplb_policy_weight).",
    "memory": "1 − KV-cache usage (or GPU memory used/total with memory_signal=gpu).",
    "latency": "1 − avg latency / baseline; 1 until the baseline is frozen after 50 requests.",
}
RANGE_0_1: dict[str, int] = {"valueMin": 0, "valueMax": 1}
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
W = f"{{{WORKERS}}}"

L = Layout()
L.row("Score").add(
    ts("Score per worker", "none", targets((f"max by (worker) ({r(M.WORKER_SCORE)})", "worker {{worker}}")),
       "Routing score each worker has right now for a request without a cached prefix (higher wins; ties rotate): "
       "the weighted sum of the terms below (default 0.3·queue + 0.2·memory + 0.2·latency + 0.3·prefix). "
       "Recomputed at every scrape over the current shm snapshot.", w=24, **RANGE_0_1),
)
for term, doc in TERM_DOC.items():
    sel = r(M.WORKER_SCORE_TERM, f'term="{term}"')
    L.add(ts(f"Score term: {term}", "none", targets((f"max by (worker) ({sel})", "worker {{worker}}")), doc, w=8,
             **RANGE_0_1))
L.row("Scoring inputs").add(
    ts("Queue vs in-flight per worker", "none",
       targets((f"max by (worker) ({r(M.WORKER_QUEUE_LENGTH)})", "queue {{worker}}"),
               (f"max by (worker) ({r(M.WORKER_REQUESTS_INFLIGHT)})", "in-flight {{worker}}")),
       "queue = running + waiting from shm + requests the router sent since the worker's last snapshot; "
       "in-flight = requests the router has open to the worker."),
    ts("KV-cache usage per worker", "percentunit",
       targets((f"max by (worker) ({r(M.WORKER_KV_CACHE_USAGE)})", "worker {{worker}}")),
       "KV-cache usage the worker published (the memory term's input).", **RANGE_0_1),
    ts("GPU memory used / total per worker", "bytes",
       targets((f"max by (worker) ({r(M.WORKER_GPU_MEMORY_USED)})", "used {{worker}}"),
               (f"max by (worker) ({r(M.WORKER_GPU_MEMORY_TOTAL)})", "total {{worker}}")),
       "NVML memory summed over the worker's GPUs (0 without a GPU, e.g. the sim engine)."),
    ts("GPU memory used ratio per worker", "percentunit",
       targets((f"max by (worker) ({r(M.WORKER_GPU_MEMORY_USED)}) / max by (worker) ({r(M.WORKER_GPU_MEMORY_TOTAL)}"
                " > 0)", "worker {{worker}}")),
       "used / total. vLLM pre-allocates --gpu-memory-utilization (≈0.9); DPLBGPUMemoryNearFull fires above 0.97. "
       "Workers without a GPU (total 0: CPU, sim) have no ratio and are left out instead of showing NaN.",
       extraJson={"fieldConfig": {"defaults": {"noValue": "no GPU"}}}, **RANGE_0_1),
    ts("Prefix cache hit rate per worker", "percentunit",
       targets((f"{engine(rate(HITS + W))} / ({engine(rate(QUERIES + W))} > 0)", "worker {{worker}}")),
       "Prompt tokens the engine served from its prefix cache / prompt tokens it looked up (vllm:prefix_cache_hits "
       "/ vllm:prefix_cache_queries, from the workers' metrics ports). The router's prefix term routes a "
       "conversation's next turn to the worker that holds its history, so this stays high; a drop on one worker "
       "after a restart is its empty cache refilling. No data while a worker gets no prompts.", **RANGE_0_1),
    ts("Average latency vs baseline", "s",
       targets((f"max by (worker) ({r(M.WORKER_LATENCY_AVG)})", "avg latency {{worker}}"),
               (f"max({M.LATENCY_BASELINE}{{{ROUTER}}})", "baseline")),
       "Mean E2E of each worker's last 10 successful requests vs the baseline (P95 of the first 50 requests; "
       "empty until frozen)."),
    ts("Worker state age", "s",
       targets((f"time() - max by (worker) ({r(M.WORKER_STATE_LAST_UPDATE)})", "heartbeat age {{worker}}"),
               (quantile(0.99, f"{M.STATE_READ_AGE}_bucket{{{ROUTER}}}"), "age of chosen state at decision, P99")),
       "Seconds since each worker's last heartbeat (0.2 s normally; stale after 0.6 s; DPLBWorkerStateStale after "
       "30 s), and how old the state was when the router decided."),
)
L.row("Lifecycle and faults").add(
    lifecycle_timeline("Lifecycle per worker: starting (model load), warming (warm-up request), ready, draining, "
                       "stopped."),
    ts("Warm-up and first-request duration per worker", "s",
       targets((f"max by (worker) ({r(M.WORKER_WARMUP_DURATION)})", "warm-up {{worker}}"),
               (f"max by (worker) ({r(M.WORKER_FIRST_REQUEST_DURATION)})", "first request {{worker}}")),
       "Warm-up request duration and the first real request after ready (0 until it happened). Model load time "
       "(dplb_worker_model_load_duration_seconds) is the separate panel beside it. "
       "DPLBWorkerColdStartSlow fires when the first request took over 10 s.", drawStyle="points", pointSize=6),
    ts("Model load duration per worker", "s",
       targets((f"max by (worker) ({r(M.WORKER_MODEL_LOAD_DURATION)})", "load {{worker}}")),
       "Engine load time of each worker's current process (model load until the engine is up; the warm-up request "
       "comes after). A 12-minute start shows here, not in the warm-up duration.", drawStyle="points", pointSize=6),
    ts("CUDA OOMs per worker", "none",
       targets((f"max by (worker) (increase({r(M.WORKER_CUDA_OOM + '_total')}[$__rate_interval]))",
                "worker {{worker}}")),
       "CUDA out-of-memory errors reported by each worker's engine (DPLBCudaOOM).", drawStyle="bars",
       fillOpacity=80),
    ts("Worker requests/s and errors/s (worker side)", "reqps",
       targets((f"sum by (worker) (rate({M.WORKER_REQUESTS}_total{{{WORKERS}, {SEL_W}}}[$__rate_interval]))",
                "requests {{worker}}"),
               (f"sum by (worker) (rate({M.WORKER_ERRORS}_total{{{WORKERS}, {SEL_W}}}[$__rate_interval]))",
                "errors {{worker}}")),
       "Model requests each worker completed and those that failed (5xx or cut), from the worker's metrics port."),
    ts("Routing decision duration P50 / P99", "s",
       targets(*[(quantile(q, f"{M.ROUTING_DECISION_DURATION}_bucket{{{ROUTER}}}"), f"P{round(q * 100)}")
                 for q in (0.5, 0.99)]),
       "shm read + pick() per request (microseconds normally)."),
    ts("Collector tick P99 per worker", "s",
       targets((quantile(0.99, f"{M.WORKER_COLLECTOR_TICK}_bucket{{{WORKERS}, {SEL_W}}}", "worker"),
                "worker {{worker}}")),
       "Time one state-collector tick takes in each worker (engine stats + NVML + shm publish)."),
)

L.row("Prefix cache routing").add(
    ts("Prefix routing outcomes", "reqps",
       targets((f"sum by (outcome) (rate({M.PREFIX_ROUTED}_total{{{ROUTER}}}[$__rate_interval]))", "{{outcome}}")),
       "Requests with a prompt prefix key: hit = sent to the worker with the longest cached prefix; spill = load "
       "sent it elsewhere (the prefix term shrinks as that worker's queue grows); miss = no worker had any block.",
       w=8),
    ts("Predicted prefix hit rate per worker", "percentunit",
       targets((f"sum by (worker) (rate({r(M.PREFIX_HIT_BLOCKS + '_total')}[$__rate_interval])) / "
                f"(sum by (worker) (rate({r(M.PREFIX_QUERY_BLOCKS + '_total')}[$__rate_interval])) > 0)",
                "worker {{worker}}")),
       "Prompt blocks the router's prefix index predicted the chosen worker has cached / blocks routed to it. Compare "
       "with the engines' measured vllm:prefix_cache_hits / queries: a prediction well above it means the engines "
       "evict sooner than the index forgets (lower --prefix-index-blocks or --prefix-ttl). No data while no prompt "
       "is long enough for a block (128 bytes).", w=8, **RANGE_0_1),
    ts("Predicted vs engine-cached prompt tokens per worker", "none",
       targets((f"max by (worker) (rate({r(M.PREFIX_PREDICTED + '_total')}[$__rate_interval])) / "
                f"(max by (worker) (rate({r(M.PREFIX_COMPARED + '_total')}[$__rate_interval])) > 0)",
                "worker {{worker}} predicted"),
               (f"max by (worker) (rate({r(M.PREFIX_ENGINE_CACHED + '_total')}[$__rate_interval])) / "
                f"(max by (worker) (rate({r(M.PREFIX_COMPARED + '_total')}[$__rate_interval])) > 0)",
                "worker {{worker}} confirmed")),
       "Per request routed to the worker, the prompt tokens the router's prefix index predicted cached and those "
       "the engine served from its prefix cache (its KV ring's comparison). The two lines of a worker overlap while "
       "the index follows that engine's KV events; predicted above confirmed means the index believes blocks the "
       "engine evicted (a worker without events, or lost events). max by worker: each router process reads the "
       "same ring counters.", w=8),
    ts("Prefix prediction error per request", "none",
       targets((f"max by (worker) (rate({r(M.PREFIX_PREDICTION_ERROR + '_total')}[$__rate_interval])) / "
                f"(max by (worker) (rate({r(M.PREFIX_COMPARED + '_total')}[$__rate_interval])) > 0)",
                "worker {{worker}} |predicted - confirmed|"),
               (f"max by (worker) ({r(M.PREFIX_ENGINE_EVENTS)})", "worker {{worker}} follows engine events")),
       "Mean |router-predicted − engine-cached| prompt tokens per request, and 1 while the index follows the "
       "worker's engine events (0: it falls back to what it sent). Tens of tokens on an event-fed worker; hundreds "
       "on the sent-bytes index under cache pressure (benchmarks/README.md).", w=8),
    ts("Prefix index size", "none",
       targets((f"max({M.PREFIX_INDEX_BLOCKS}{{{ROUTER}}})", "blocks"),
               (f"max({M.PREFIX_INDEX_CAPACITY}{{{ROUTER}}})", "capacity")),
       "Blocks in the router's prefix index (LRU) and its capacity; memory ≈ 180 bytes a block "
       f"({M.PREFIX_INDEX_BYTES}).", w=8),
)

dashboard = make_dashboard(
    "DPLB routing and workers", "dplb-routing",
    "Every scoring input per worker as the router's scorer sees it (queue, in-flight, KV, GPU memory, latency vs "
    "baseline, state age), the score and its terms, lifecycle, warm-up, OOMs and decision cost. "
    "Generated from dashboards/dplb-routing.dashboard.py; do not edit the JSON.", L)
