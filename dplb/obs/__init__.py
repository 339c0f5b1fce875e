"""Observability: every metric name (:mod:`dplb.obs.metrics`), the families of each job that exports them
(``dplb.obs.metrics_router``, ``metrics_scrape``, ``metrics_host``, ``metrics_tenant``, ``metrics_worker``), the
lock-free hot-path histogram and counter families (``dplb.obs.fastmetrics``) and the OpenTelemetry tracing
(:mod:`dplb.obs.tracing`).

Layer rule: imports the state plane, the policy's data and the foundation; never the router, the worker or ops.
"""
