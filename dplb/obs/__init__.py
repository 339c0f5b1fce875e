"""Observability: every metric name (:mod:`dplb.obs.metrics`) and the OpenTelemetry tracing (:mod:`dplb.obs.tracing`).

Layer rule: imports the state plane, the policy's data and the foundation; never the router, the worker or ops.
"""
