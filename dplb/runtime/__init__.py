"""Process runtime helpers shared by the router, the worker and the launcher.

- :mod:`dplb.runtime.asgi`: the one JSON responder and body-receive loop of raw-ASGI code.
- :mod:`dplb.runtime.serving`: sockets, the uvicorn server, fd limits.
- :mod:`dplb.runtime.protocol`: the HTTP/1.1 server protocol (bounded heads, the disconnect hook, the lean cycle
  of the direct relay's requests); :mod:`dplb.runtime.rejection`: its rejection path (the head cap, 400 and 431).
- :mod:`dplb.runtime.edge`: the protocol's parts (disconnect hook, corked transport, canned error responses,
  HTTP/1.0 close-delimited framing); :mod:`dplb.runtime.conn_timer`: a connection's one timer (keep-alive, read
  timeouts).
- :mod:`dplb.runtime.direct`: answering a request from the protocol's callbacks (:class:`DirectResponse`).
- :mod:`dplb.runtime.procs`: child-process helpers (parent-death signal).
- :mod:`dplb.runtime.gpu`: NVML discovery and sampling.
- :mod:`dplb.runtime.sd_notify`: systemd's notify protocol and watchdog.

Layer rule: imports only the foundation (:mod:`dplb.config`, :mod:`dplb.errors`).
"""
