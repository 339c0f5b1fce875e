"""Process runtime helpers shared by the router, the worker and the launcher.

- :mod:`dplb.runtime.asgi`: the one JSON responder and body-receive loop of raw-ASGI code.
- :mod:`dplb.runtime.serving`: sockets, the uvicorn server, fd limits, the disconnect hook.
- :mod:`dplb.runtime.procs`: child-process helpers (parent-death signal).
- :mod:`dplb.runtime.gpu`: NVML discovery and sampling.
- :mod:`dplb.runtime.sd_notify`: systemd's notify protocol and watchdog.

Layer rule: imports only the foundation (:mod:`dplb.config`, :mod:`dplb.errors`).
"""
