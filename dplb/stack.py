"""Where a stack lives on its host: the run directory of its sockets, the router's port and the workers' metrics
ports, and how a second stack on another ``--port`` derives its own (README "A second stack on one host").

Contract: pure functions of their arguments and the environment (``$DPLB_RUN_DIR``, ``$XDG_RUNTIME_DIR``); each
default is written here once. Imports nothing of DPLB's.
"""

from __future__ import annotations

import os

ENV_RUN_DIR = "DPLB_RUN_DIR"


def default_run_dir() -> str:
    """Where worker sockets live: ``$DPLB_RUN_DIR``, else ``$XDG_RUNTIME_DIR/dplb``, else ``/tmp/dplb-<uid>``.
    (Under systemd ``RuntimeDirectory=dplb`` gives ``/run/dplb`` through ``DPLB_RUN_DIR``.)"""
    if os.environ.get(ENV_RUN_DIR):
        return os.environ[ENV_RUN_DIR]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "dplb")
    return f"/tmp/dplb-{os.getuid()}"


#: Worker K serves its metrics on METRICS_PORT_BASE + K unless told otherwise (the router's default port is 30000).
METRICS_PORT_BASE = 30001
#: Where worker metrics listen by default (loopback: they carry no auth). ``--metrics-host`` changes it.
METRICS_HOST = "127.0.0.1"


#: The router's default port; a stack on another ``--port`` derives its own run dir and metrics ports from it.
DEFAULT_PORT = 30000


def stack_run_dir(port: int) -> str:
    """The default run directory of the stack whose router listens on ``port``: :func:`default_run_dir` for
    :data:`DEFAULT_PORT` (or when ``$DPLB_RUN_DIR`` names one), else that path with ``-<port>`` appended, so a
    second stack on one host needs only ``--port`` (README "A second stack")."""
    base = default_run_dir()
    return base if port == DEFAULT_PORT or os.environ.get(ENV_RUN_DIR) else f"{base}-{port}"


def stack_metrics_port_base(port: int, given: int | None) -> int:
    """The workers' metrics port base of the stack on router ``port``: ``given`` (``--metrics-port-base``) when
    set, else :data:`METRICS_PORT_BASE` for :data:`DEFAULT_PORT`, else ``port + 1`` (worker K on
    ``port + 1 + K``; ports 30000–30000+N of the first stack stay clear when the second is ≥ N + 1 above it)."""
    if given is not None:
        return given
    return METRICS_PORT_BASE if port == DEFAULT_PORT else port + 1


def worker_metrics_ports(base: int | None, num_workers: int) -> list[int]:
    """TCP ports the workers' metrics servers bind: ``base + K`` (``None`` = :data:`METRICS_PORT_BASE`; 0 = none)."""
    b = METRICS_PORT_BASE if base is None else base
    return [b + k for k in range(num_workers)] if b else []
