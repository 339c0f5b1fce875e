"""Child-process helpers shared by the launcher (:mod:`dplb.ops.launcher`) and the router's process group
(:mod:`dplb.router.supervisor`)."""

from __future__ import annotations

import contextlib
import os
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


def reap_group(pgid: int) -> bool:
    """SIGKILL what is left of process group ``pgid`` once its leader has exited: a child started as a group leader
    (``start_new_session=True`` or ``process_group=0``) leaves its own children in that group, and a vLLM worker's
    ``EngineCore`` outlives a worker killed by SIGKILL (it is re-parented and keeps the GPU memory), so the next
    start would meet CUDA OOM. Returns True when something was signalled; never raises (an empty or foreign group
    is a no-op)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
        return True
    return False
