"""Whether the router's hot path runs compiled: the modules ``scripts/build_native.sh`` compiles with mypyc.

The build is opt-in (README, "Optional: compile the hot path"): ``scripts/build_native.sh`` builds one extension
module per entry of :data:`HOT_MODULES` next to its ``.py`` file, and Python's import system then loads the
extension instead of the source; ``scripts/build_native.sh --clean`` removes them and the pure-Python modules are
used again. Both behave the same (the same source; tests run against either). The router says which it runs in
its start-up log line and in the ``compiled`` label of ``dplb_build_info`` (:func:`build_label`).

Imports nothing of DPLB's: it only asks the import system where each module comes from. :func:`mypyc_attr` and
:func:`trait` are ``mypy_extensions``'s to mypy and mypyc, no-ops otherwise (mypy_extensions is not a dependency).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr, trait
else:
    def mypyc_attr(*_args: object, **_kwargs: object):
        """``mypy_extensions.mypyc_attr`` for pure Python: it only means something to mypyc, which reads the
        decorator from the source (``allow_interpreted_subclasses=True`` on a compiled class that plugins, tests or
        modules not compiled subclass); at run time it returns the class unchanged."""
        return lambda cls: cls

    def trait(cls):
        """``mypy_extensions.trait`` for pure Python: to mypyc, a class of methods that a compiled class may take in
        besides its base class (called through a table, not looked up by name); at run time the class unchanged."""
        return cls


#: The modules compiled by scripts/build_native.sh (dotted names): the client-side HTTP protocol, the request's
#: path through the router and the worker-side HTTP client, the policy's pick and the shm reads it works on, and
#: the per-request metrics.
HOT_MODULES: tuple[str, ...] = (
    "dplb.runtime.direct", "dplb.runtime.protocol", "dplb.runtime.lane_cycle", "dplb.runtime.edge",
    "dplb.runtime.conn_timer",
    "dplb.router.direct", "dplb.router.upstream", "dplb.router.attempt", "dplb.router.exchange",
    "dplb.router.proxy", "dplb.router.state", "dplb.router.resume", "dplb.router.orca", "dplb.router.routes",
    "dplb.router.models",
    "dplb.policy.core", "dplb.policy.fused", "dplb.policy.scorers", "dplb.policy.prefix", "dplb.policy.decision",
    "dplb.policy.pickers", "dplb.policy.filters", "dplb.policy.framework", "dplb.policy.plugins",
    "dplb.policy.stall",
    "dplb.obs.fastmetrics", "dplb.obs.metrics_router",
    "dplb.state.router_slots", "dplb.state.shm", "dplb.state.worker_state", "dplb.state.kv_rings",
    "dplb.state.layout",
)


def _origin(name: str) -> str:
    """The file module ``name`` was (or would be) loaded from; "" when it cannot be found."""
    mod = sys.modules.get(name)
    if mod is not None:
        return getattr(mod, "__file__", None) or ""
    try:
        spec = importlib.util.find_spec(name)  # imports the parent packages, not the module itself
    except (ImportError, ValueError):
        return ""
    return (spec.origin or "") if spec is not None else ""


def compiled_modules() -> list[str]:
    """The entries of :data:`HOT_MODULES` that are (or will be) loaded from an extension module (``.so``)."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return [m for m in HOT_MODULES if _origin(m).endswith(suffixes)]


def stale_modules() -> list[str]:
    """The compiled entries of :data:`HOT_MODULES` whose ``.py`` file changed after their extension module was
    built (by modification time): the extension runs the old code until ``scripts/build_native.sh`` runs again."""
    out = []
    for m in compiled_modules():
        so = _origin(m)
        py = os.path.join(os.path.dirname(so), m.rsplit(".", 1)[-1] + ".py")
        try:
            if os.stat(py).st_mtime > os.stat(so).st_mtime:
                out.append(m)
        except OSError:  # no source next to it (an installed build): nothing to compare
            continue
    return out


def build_label() -> str:
    """``"true"`` when every hot module is compiled, ``"false"`` when none is, ``"partial"`` otherwise (a build
    that failed half way, or ``.so`` files left from another source tree)."""
    n = len(compiled_modules())
    return "true" if n == len(HOT_MODULES) else "false" if n == 0 else "partial"


def describe() -> str:
    """One line for the router's start-up log: ``"compiled (32/32 hot modules)"`` or ``"pure Python"``; a build
    older than its source says so (``"compiled (32/32 hot modules; 2 older than their .py: dplb.policy.core, …;
    rebuild with scripts/build_native.sh)"``)."""
    n = len(compiled_modules())
    if n == 0:
        return "pure Python"
    stale = stale_modules()
    extra = (f"; {len(stale)} older than their .py: {', '.join(stale)}; rebuild with scripts/build_native.sh"
             if stale else "")
    return f"compiled ({n}/{len(HOT_MODULES)} hot modules{extra})"
