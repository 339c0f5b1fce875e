"""DPLB overview: is it up, how much traffic, how fast, who gets it, what is rejected. → dplb-overview.json"""

from _common import (
    PROXY_ROUTES,
    ROUTER,
    Layout,
    lifecycle_timeline,
    make_dashboard,
    quantile,
    r,
    rate,
    stat,
    targets,
    ts,
)

from dplb.obs import metrics as M

DEC = M.ROUTING_DECISIONS + "_total"
REJ = M.REQUESTS_REJECTED + "_total"
HTTP = M.HTTP_REQUESTS + "_total"
E2E = M.UPSTREAM_REQUEST_DURATION + "_bucket"
TTFB = M.UPSTREAM_TTFB + "_bucket"
RED_GREEN = [{"color": "red", "value": None}, {"color": "green", "value": 1}]

L = Layout()
L.row("Health").add(
    stat("Routable workers", "none", f"sum({M.WORKER_UP}{{{ROUTER}}})",
         "Workers the router may pick now (ready, fresh heartbeat). 0 = every request gets 503. "
         "Alerts: DPLBNoRoutableWorker, DPLBWorkerDown.", steps=RED_GREEN),
    stat("Registered workers", "none", f"max({M.WORKERS_REGISTERED}{{{ROUTER}}})",
         "Workers that have written their shm slot at least once. 0 = DPLBNoWorkerRegistered.", steps=RED_GREEN),
    stat("Shm segment present", "none", f"min({M.SHM_SEGMENT_PRESENT}{{{ROUTER}}})",
         "1 when the router reads worker state from the shared-memory segment; 0 = routing blind on its own "
         "in-flight counts (DPLBShmSegmentMissing).", steps=RED_GREEN,
         mappings=[{"type": "value", "options": {"0": {"text": "MISSING", "index": 0},
                                                 "1": {"text": "present", "index": 1}}}]),
    stat("Requests/s", "reqps", f"sum(rate({HTTP}{{{ROUTER}, {PROXY_ROUTES}}}[$__rate_interval]))",
         "Model requests (chat, completions, embeddings) the router receives."),
    stat("Rejected share", "percentunit",
         f"sum(rate({REJ}{{{ROUTER}}}[$__rate_interval])) / sum(rate({HTTP}{{{ROUTER}, {PROXY_ROUTES}}}"
         "[$__rate_interval]))",
         "Share of requests the router answered itself with an error (DPLBRequestsRejected above 5%).",
         steps=[{"color": "green", "value": None}, {"color": "orange", "value": 0.01},
                {"color": "red", "value": 0.05}]),
    stat("CUDA OOMs in range", "none", f"sum(increase({M.WORKER_CUDA_OOM}_total{{{ROUTER}}}[$__range]))",
         "CUDA out-of-memory errors the workers reported in the dashboard's time range (DPLBCudaOOM).",
         steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}]),
)
L.row("Traffic").add(
    ts("Router requests/s by route and status", "reqps",
       targets((f"sum by (route, status) (rate({HTTP}{{{ROUTER}}}[$__rate_interval]))", "{{route}} {{status}}")),
       "Every HTTP request the router answered, by route template and status code."),
    ts("Upstream requests/s by worker and outcome", "reqps",
       targets((f"sum by (worker, outcome) ({rate(r(M.UPSTREAM_REQUEST_DURATION + '_count'))})",
                "worker {{worker}} {{outcome}}")),
       "Requests proxied to each worker, by outcome (ok, upstream_5xx, timeout, client_disconnect, …)."),
    ts("Decision share per worker", "percentunit",
       targets((f"sum by (worker) ({rate(r(DEC))}) / on () group_left () sum(rate({DEC}{{{ROUTER}}}"
                "[$__rate_interval]))", "worker {{worker}}")),
       "Share of routing decisions that chose each worker (decisions that found no worker are not a worker: "
       "see 'Decisions/s by reason'). "
       "A lasting skew is DPLBLoadImbalance.", stacking={"mode": "normal", "group": "A"}, fillOpacity=30),
    ts("Decisions/s by reason", "reqps",
       targets((f"sum by (reason) (rate({DEC}{{{ROUTER}}}[$__rate_interval]))", "{{reason}}")),
       "Why each worker was chosen: score, affinity (prefix), policy, fallback (no shm segment), or why none was "
       "(no_workers, none_routable, all_over_cap)."),
    ts("Rejected requests/s by reason", "reqps",
       targets((f"sum by (reason) (rate({REJ}{{{ROUTER}}}[$__rate_interval]))", "{{reason}}")),
       "Requests the router answered itself with an error, by reason code (the error body's code). "
       "Alerts: DPLBRequestsRejected, DPLBNoRoutableWorker, DPLBNoWorkerRegistered."),
    ts("Upstream retries/s", "reqps",
       targets((f"sum(rate({M.UPSTREAM_RETRIES}_total{{{ROUTER}}}[$__rate_interval]))", "retries")),
       "Requests re-sent to the next-best worker after the first could not be reached."),
)
L.row("Latency (router to worker, successful requests)").add(
    ts("E2E latency P50 / P95 / P99", "s",
       targets(*[(quantile(q, r(E2E, 'outcome="ok"')), f"P{round(q * 100)}") for q in (0.5, 0.95, 0.99)]),
       "End-to-end duration of proxied requests over the selected workers, from dispatch to the last byte."),
    ts("Time to first byte P50 / P95 / P99", "s",
       targets(*[(quantile(q, r(TTFB)), f"P{round(q * 100)}") for q in (0.5, 0.95, 0.99)]),
       "Dispatch to the worker's first response byte: time to first token for streams."),
    ts("E2E latency P95 by worker", "s",
       targets((quantile(0.95, r(E2E, 'outcome="ok"'), "worker"), "worker {{worker}}")),
       "A worker much slower than the others loses traffic through the latency term."),
    ts("Time to first byte P95 by worker", "s",
       targets((quantile(0.95, r(TTFB), "worker"), "worker {{worker}}")),
       "A high TTFB on one worker: a long queue there, or a cold worker (DPLBWorkerColdStartSlow)."),
)
L.row("Workers").add(
    lifecycle_timeline("Each worker's lifecycle as the router reads it from shm: starting (model load), warming "
                       "(warm-up request), ready, draining, stopped. Alerts: DPLBWorkerStuckWarming, DPLBWorkerDown."),
    ts("Worker routable (up)", "none",
       targets((f"max by (worker) ({r(M.WORKER_UP)})", "worker {{worker}}")),
       "1 when the router may pick the worker (ready and heartbeat younger than 3 state intervals).",
       drawStyle="line", lineInterpolation="stepAfter"),
    ts("Shm errors/s by operation", "cps",
       targets((f"sum by (operation, error) (rate({M.SHM_ERRORS}_total{{{ROUTER}}}[$__rate_interval]))",
                "{{operation}} {{error}}")),
       "Failed segment attaches and removals the router noticed (the 'Shm segment present' stat shows 0 meanwhile)."),
)
L.row("Router capacity").add(
    ts("Router CPU per process (1 = one core)", "percentunit",
       targets((f"sum(rate(process_cpu_seconds_total{{{ROUTER}}}[$__rate_interval])) / max({M.ROUTER_PROCESSES}"
                f"{{{ROUTER}, state=\"configured\"}})", "CPU per router process")),
       "CPU time of the router's processes over their number: one process is one core, so near 100% the router "
       "caps throughput (DPLBRouterSaturated: raise --processes)."),
    ts("Router processes", "none",
       targets((f"max by (state) ({M.ROUTER_PROCESSES}{{{ROUTER}}})", "{{state}}")),
       "configured = --processes; answered = processes whose metrics the last scrape merged "
       "(DPLBRouterProcessDown when fewer).", drawStyle="line", lineInterpolation="stepAfter"),
)
# Tenants (docs/DESIGN.md §15): one series per tenant (the configured ones and "default"), one per class for SLOs.
# Without --tenants, --api-key or --access-log the router keeps no tenant ledger: these panels say "no tenants".
_T = f"{{{ROUTER}}}"
_NO_TENANTS = {"fieldConfig": {"defaults": {"noValue": "no tenants"}}}
_BUDGET = (f"1 - (sum by (priority, slo) (increase({M.TENANT_SLO_EVENTS}_total{{{ROUTER}, result=\"bad\"}}[30d])) "
           f"/ sum by (priority, slo) (increase({M.TENANT_SLO_EVENTS}_total{_T}[30d]))) "
           f"/ on (priority, slo) (1 - max by (priority, slo) ({M.TENANT_SLO_OBJECTIVE}{_T}))")
L.row("Tenants").add(
    ts("Tokens/s by tenant", "none",
       targets((f"sum by (tenant, kind) (rate({M.TENANT_TOKENS}_total{_T}[$__rate_interval]))", "{{tenant}} {{kind}}")),
       "Prompt, completion and cached tokens per second by tenant: the engines' usage counts (dplb usage prints the "
       "totals).", extraJson=_NO_TENANTS),
    ts("Requests/s by tenant and outcome", "reqps",
       targets((f"sum by (tenant, outcome) (rate({M.TENANT_REQUESTS}_total{_T}[$__rate_interval]))",
                "{{tenant}} {{outcome}}")),
       "ok, client_error (the worker's 4xx), rejected (401/403/429 by the router: keys, models, limits, queue "
       "share), server_error (5xx: what the availability SLO counts), cancelled.", extraJson=_NO_TENANTS),
    ts("Queue wait P99 by tenant", "s",
       targets((quantile(0.99, f"{M.TENANT_QUEUE_WAIT}_bucket{_T}", "tenant"), "{{tenant}}")),
       "How long requests waited in the router's fair queue for a batch slot (0 with --api-key alone).",
       extraJson=_NO_TENANTS),
    ts("TTFT P99 by tenant", "s",
       targets((quantile(0.99, f"{M.TENANT_TTFT}_bucket{_T}", "tenant"), "{{tenant}}")),
       "Arrival at the router to the first token of a streamed response, queue wait included (a response that is "
       "not a stream is not counted: its first byte is the whole answer).", extraJson=_NO_TENANTS),
    ts("Error budget remaining (30 d) by class", "percentunit",
       targets((_BUDGET, "{{priority}} {{slo}}")),
       "1 − (bad ÷ all SLO events over 30 days) ÷ (1 − objective), per priority class and SLO of the tenants file "
       "(DPLBErrorBudgetBurn pages when it burns fast). No value without [slo.<class>] in the tenants file.",
       w=24, extraJson={"fieldConfig": {"defaults": {"noValue": "no SLO"}}}),
)

dashboard = make_dashboard(
    "DPLB overview", "dplb-overview",
    "DPLB router: health, traffic by worker and status, decisions, rejects, latency percentiles, worker lifecycle. "
    "Generated from dashboards/dplb-overview.dashboard.py; do not edit the JSON.", L)
