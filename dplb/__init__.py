"""DPLB: a data-parallel load balancer for vLLM workers on one GPU server.

One router (OpenAI API on :30000) in front of N workers (vLLM or the sim engine) on Unix sockets; worker state
travels through a shared-memory segment (:mod:`dplb.state.shm`) and is scored by :mod:`dplb.policy`.
"""

__version__ = "0.1.0"

from dplb import native as _native

# Before any compiled hot module loads, in every process that imports the package: refuse a partial or stale build
# (dplb.native.ImportGuard).
_native.guard_imports()
