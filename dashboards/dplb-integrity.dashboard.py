"""DPLB integrity: stalled workers, failed-fast and resumed streams, passive ejections, retries, panic routing, and the
worker's in-flight reconciliation (docs/DESIGN.md §5.1, §8.1, §13, §14). → dplb-integrity.json"""

from _common import RI, ROUTER, WORKERS, Layout, make_dashboard, r, targets, ts

from dplb.obs import metrics as M

BY_W = "sum by (worker)"
W = f'{{{WORKERS}, worker=~"$worker"}}'

L = Layout()
L.row("Stalls (engine progress)").add(
    ts("Stalled workers", "none", targets((f"max by (worker) ({r(M.WORKER_STALLED)})", "worker {{worker}}")),
       "1 while a worker has requests in flight and its engine made no progress (no token, no prefill step) for "
       "--stall-after seconds: out of rotation (runbook DPLBWorkerStalled).",
       drawStyle="line", lineInterpolation="stepAfter", valueMin=0, valueMax=1),
    ts("Stalls and requests failed fast per worker (per minute)", "none",
       targets((f"{BY_W} (increase({r(M.WORKER_STALLS + '_total')}[{RI}]))", "stalls {{worker}}"),
               (f"{BY_W} (increase({r(M.STALLED_REQUESTS_FAILED + '_total')}[{RI}]))", "failed fast {{worker}}")),
       "Times each worker was found stalled, and its in-flight requests the router failed fast (504 "
       "worker_stalled, or an SSE error event) instead of letting clients wait."),
)
L.row("Failures the router absorbed").add(
    ts("Ejections per worker (per minute)", "none",
       targets((f"{BY_W} (increase({r(M.WORKER_EJECTIONS + '_total')}[{RI}]))", "worker {{worker}}")),
       "Passive health check: a worker ejected for a few seconds after consecutive failed responses."),
    ts("Retries and resumed streams/s", "reqps",
       targets((f"sum (rate({M.UPSTREAM_RETRIES}_total{{{ROUTER}}}[{RI}]))", "retried before the first byte"),
               (f"sum (rate({M.STREAMS_RESUMED}_total{{{ROUTER}}}[{RI}]))", "streams resumed"),
               (f"sum by (reason) (rate({M.STREAM_RESUME_REFUSED}_total{{{ROUTER}}}[{RI}]))",
                "resume refused: {{reason}}")),
       "Requests re-sent to another worker before any byte reached the client, broken SSE streams continued on "
       "another worker (--resume-streams), and streams that could not be resumed (the client got an error event)."),
    ts("Panic routing", "none",
       targets((f"max ({M.PANIC}{{{ROUTER}}})", "in panic (any router process)"),
               (f"sum (increase({M.PANIC_ROUTED}_total{{{ROUTER}}}[{RI}]))",
                "requests routed in panic (per minute)")),
       "1 while no worker is routable and the router routes among the workers on heartbeat probation (fresh "
       "again, ready) instead of answering 503; and the requests it routed so (docs/DESIGN.md §5.1, runbook "
       "DPLBPanicRouting)."),
)
L.row("In-flight reconciliation (worker side)").add(
    ts("Orphan engine requests and leaked in-flight per worker", "none",
       targets((f"{BY_W} ({M.WORKER_ORPHANS}{W})", "orphans {{worker}}"),
               (f"{BY_W} ({M.WORKER_LEAKED_INFLIGHT}{W})", "leaked in-flight {{worker}}")),
       "Orphans: requests the engine holds that no client waits for (the reconciler aborts them). Leaked: "
       "requests the routers count in flight that are not open on the worker's socket (runbook "
       "DPLBInflightMismatch)."),
    ts("Reconciler aborts per worker (per minute)", "none",
       targets((f"{BY_W} (increase({M.WORKER_ORPHAN_ABORTS}_total{W}[{RI}]))", "worker {{worker}}"),
               (f"{BY_W} ({M.WORKER_ENGINE_REQUESTS}{W})", "engine holds {{worker}}")),
       "Aborts the reconciler sent for orphans (each one an abort a client's disconnect should have caused), beside "
       "the requests the engine held at the reconciler's last tick."),
)


dashboard = make_dashboard(
    "DPLB integrity", "dplb-integrity",
    "Stalled workers, requests failed fast, passive ejections, retries, resumed streams, panic routing and the "
    "workers' in-flight reconciliation. Generated from dashboards/dplb-integrity.dashboard.py; do not edit the "
    "JSON.", L)
