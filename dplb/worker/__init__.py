"""The worker side: one process per engine (:mod:`dplb.worker.process`) that serves the engine on a Unix socket and
publishes its state into its slot every interval; the engines under :mod:`dplb.worker.engines` (vLLM, the sim).

Layer rule: never imports :mod:`dplb.router` (and the router never imports this package).
"""
