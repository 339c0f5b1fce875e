"""Which worker serves which model names (base model and LoRA adapters): the router's side table, and the one
model-eligibility rule of the routing (to become a policy filter when the policy grows filters).

Contract
- :class:`ServedModels` keeps, per worker, the ids of vLLM's ``GET /v1/models`` answer (served model names and
  loaded LoRA adapters), at most :data:`MAX_NAMES_PER_WORKER` names of at most :data:`MAX_NAME_BYTES` bytes each
  (more are dropped with one warning), and an inverted index name → workers.
- :meth:`ServedModels.workers_not_serving` is the hot-path check (dict/set lookups, no I/O): for a model some
  known worker serves, every other worker (including those whose list is not known yet, so nothing is misrouted
  while a worker's first answer is pending); for a model no known worker serves, the known workers (so a worker
  whose list is still unknown may take it and answer for itself). When every worker is known and none serves it,
  the caller answers 404 ``model_not_found`` with :meth:`ServedModels.names` (a tenant with an allow-list is told
  only its allowed names: :mod:`dplb.router.tenancy`).
- :meth:`ServedModels.defaults`: each known worker's *default model*, the one it serves a request without
  ``model`` (or with ``null`` or ``""``) under: vLLM's first served model name (``base_model_paths[0]``, the first
  ``/v1/models`` entry, whose ``parent`` is null; adapters name their base in ``parent``). The tenant gate checks a
  model-less request of a tenant with an allow-list against it.
- :meth:`ServedModels.refresh_loop` (a background task) asks each routable worker's ``/v1/models`` over its socket:
  at once (within :data:`TICK_S`) when it becomes routable or restarts under a new pid, then every
  ``refresh_s`` seconds; the router's LoRA fan-out refreshes the workers it touched right after. Update delay: a
  change made through the router is seen at once; one made behind its back within ``refresh_s`` + one fetch.
  A worker whose fetch fails keeps its last list (it is not routable while it is down anyway).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import msgspec

from dplb.errors import UpstreamError
from dplb.router.upstream_pool import UpstreamPool, fetch

log = logging.getLogger("dplb.router.models")
MAX_NAMES_PER_WORKER = 256
MAX_NAME_BYTES = 256
TICK_S = 0.25  # how often the refresher looks for workers that became routable
FETCH_TIMEOUT_S = 5.0
RETRY_S = 1.0  # a worker whose list could not be fetched yet is asked again after this long


class _Models(msgspec.Struct):
    data: list[dict[str, object]] = []


_decode = msgspec.json.Decoder(_Models).decode


def model_ids(body: bytes) -> list[dict[str, object]]:
    """The ``data`` entries of a ``/v1/models`` body. Raises ``msgspec.DecodeError``/``ValidationError``."""
    return [e for e in _decode(body).data if isinstance(e.get("id"), str)]


class ServedModels:
    """Side table worker → served model names (see module docstring). Single event loop; not thread-safe."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._all = frozenset(range(num_workers))
        self._names: list[frozenset[str] | None] = [None] * num_workers  # None = not known yet
        self._pid = [0] * num_workers
        self._fetched_at = [0.0] * num_workers
        self._index: dict[str, frozenset[int]] = {}
        self._not_serving: dict[str, frozenset[int]] = {}  # name → every worker not serving it (known or not)
        self._known: frozenset[int] = frozenset()
        self._default: list[str | None] = [None] * num_workers
        self._warned = False

    # ---- hot path --------------------------------------------------------------------------------------------
    def workers_not_serving(self, model: str) -> frozenset[int]:
        """Workers the request for ``model`` must not go to (module docstring). O(1) lookups, no I/O."""
        excl = self._not_serving.get(model)
        return excl if excl is not None else self._known

    def none_serves(self, model: str) -> bool:
        """True when every worker's list is known and none has ``model``."""
        return model not in self._index and len(self._known) == self.num_workers

    def names(self) -> list[str]:
        """Every served name, sorted (for the ``model_not_found`` message)."""
        return sorted(self._index)

    def defaults(self) -> dict[int, str]:
        """Worker → its default model (module docstring), for the workers whose list is known and has one."""
        return {k: d for k, d in enumerate(self._default) if d is not None}

    # ---- updates ---------------------------------------------------------------------------------------------
    def update(self, worker: int, pid: int, names: Iterable[str], default: str | None = None) -> None:
        """Set ``worker``'s served names (bounded, see module docstring) as published by process ``pid``, and
        its ``default`` model (None: the first name kept)."""
        kept: list[str] = []
        for n in names:
            if len(kept) >= MAX_NAMES_PER_WORKER or len(n.encode()) > MAX_NAME_BYTES:
                if not self._warned:
                    log.warning("worker %d serves more than %d model names or a name over %d bytes; the extra names "
                                "are not routed to it", worker, MAX_NAMES_PER_WORKER, MAX_NAME_BYTES)
                    self._warned = True
                continue
            kept.append(n)
        new = frozenset(kept)
        self._default[worker] = default if default in new else (kept[0] if kept else None)
        old = self._names[worker]
        self._pid[worker] = pid
        self._fetched_at[worker] = time.monotonic()
        if new == old:
            return
        if old is not None:
            log.info("worker %d now serves %s (was %s)", worker, sorted(new), sorted(old))
        self._names[worker] = new
        self._rebuild()

    def _rebuild(self) -> None:
        index: dict[str, set[int]] = {}
        for k, ns in enumerate(self._names):
            for n in ns or ():
                index.setdefault(n, set()).add(k)
        self._index = {n: frozenset(ws) for n, ws in index.items()}
        self._not_serving = {n: self._all - ws for n, ws in self._index.items()}
        self._known = frozenset(k for k, ns in enumerate(self._names) if ns is not None)

    def due(self, worker: int, pid: int, refresh_s: float, now: float) -> bool:
        """True when ``worker`` (publishing ``pid``) should be asked again."""
        wait = refresh_s if self._names[worker] is not None else RETRY_S
        return pid != self._pid[worker] or now - self._fetched_at[worker] >= wait

    async def refresh(self, pool: UpstreamPool, worker: int, pid: int) -> list[dict[str, object]] | None:
        """Ask ``worker`` for its ``/v1/models`` now and update the table; returns the entries, None on failure."""
        try:
            status, body = await fetch(pool, worker, "/v1/models", FETCH_TIMEOUT_S)
            if status != 200:
                raise UpstreamError(f"HTTP {status}")
            entries = model_ids(body)
        except (UpstreamError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.info("worker %d could not list its models: %s", worker, e)
            self._pid[worker], self._fetched_at[worker] = pid, time.monotonic()  # retried later, not every tick
            return None
        base = next((str(e["id"]) for e in entries if e.get("parent") is None), None)
        self.update(worker, pid, (str(e["id"]) for e in entries), base)
        return entries

    async def refresh_loop(self, pool: UpstreamPool, routable: Callable[[], list[int]],
                           pid_of: Callable[[int], int], refresh_s: float) -> None:
        """Keep the table current until cancelled (module docstring)."""
        while True:
            try:
                now = time.monotonic()
                todo = [(k, pid_of(k)) for k in routable()]
                todo = [(k, pid) for k, pid in todo if self.due(k, pid, refresh_s, now)]
                if todo:
                    await asyncio.gather(*(self.refresh(pool, k, pid) for k, pid in todo))
            except Exception:  # keep refreshing whatever happens
                log.exception("model list refresh failed")
            await asyncio.sleep(TICK_S)


__all__ = ["MAX_NAMES_PER_WORKER", "MAX_NAME_BYTES", "ServedModels", "model_ids"]
