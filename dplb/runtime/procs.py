"""Child-process helpers shared by the launcher (:mod:`dplb.ops.launcher`) and the router's process group
(:mod:`dplb.router.supervisor`)."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """In the child, before exec: get SIGTERM (→ drain) when the parent dies, even by SIGKILL (Linux
    ``PR_SET_PDEATHSIG``), so a killed launcher or router parent leaves no orphans holding GPUs or a port.
    A no-op where ``prctl`` is missing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
