"""DPLB: a data-parallel load balancer for vLLM workers on one GPU server.

One router (OpenAI API on :30000) in front of N workers (vLLM or the sim engine) on Unix sockets; worker state
travels through a shared-memory segment (:mod:`dplb.state.shm`) and is scored by :mod:`dplb.policy`.
"""

__version__ = "0.1.0"
