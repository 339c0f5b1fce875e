"""The tenant gate's waiting room: the room of the workers (free batch slots) and the requests that wait in the
router's fair queue for one (docs/DESIGN.md §15). Only with a tenants file: :class:`dplb.router.tenancy.Gate` owns
one then and calls it.

Contract
- Room: worker ``k`` has ``max_num_seqs(k) − open(k) − granted(k) − held(k)`` free slots (:meth:`WaitingRoom.free`),
  where ``open`` is every router process's in-flight requests to ``k`` (:meth:`RouterState.inflight_all`: running +
  waiting in the engine as far as DPLB sent them, plus those in transit), ``max_num_seqs`` is what the worker
  publishes (the policy's ``max_queue`` when it publishes none), ``granted`` counts requests let out of the queue
  that have not reached :meth:`RouterState.acquire` yet and ``held`` the slots held for a tenant's next request
  (anticipation, :meth:`dplb.router.admission.FairQueue.anticipate`). A request of class rank ``r`` sees room only
  in the free slots beyond :meth:`TenantsConfig.held` (``[priorities] reserve``, kept for the more urgent classes):
  :meth:`WaitingRoom.best`. A request let through is routed among the workers with room only
  (:meth:`WaitingRoom.steer`). In panic (docs/DESIGN.md §5.1) the workers panic routing routes among count as
  routable here, with the same room. All of this is synchronous: the gate's immediate admission (and so the direct
  relay's) reads it without waiting.
- :meth:`WaitingRoom.wait` (async): the request (counted by the gate, its counter lifted) waits in the router —
  never in the engines — until :meth:`WaitingRoom.pump` grants it a freed slot (True: it is steered and prepared),
  it times out (429 ``queue_timeout``), it is pushed out (429 ``queue_share_exceeded``), the queue is full, the
  router drains (503 ``router_draining``), or its client leaves (499, nothing sent); answered (False), its token
  reservation goes back (the gate's ``refund``). The queue wait is observed either way (the gate's ``observe``).
- :meth:`WaitingRoom.pump` grants queued requests while workers have room (a router group's peer with a more urgent
  class queued goes first: its own tick takes the slot); a ticker looks again every :data:`TICK_S` while requests
  wait or slots are held (room freed by other processes, timeouts, holds past their time).
- :meth:`WaitingRoom.anticipate`: a request that ended on a worker may hold its slot for its tenant's next one.
- :meth:`WaitingRoom.close`: every queued request is answered 503 ``router_draining``; none waits any more.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dplb.errors import RouterErrorKind
from dplb.router.admission import FairQueue, QueueRefusal, Waiter
from dplb.router.ticket import Ticket
from dplb.runtime.asgi import until_disconnect
from dplb.runtime.serving import DISCONNECT_EXT

if TYPE_CHECKING:
    from dplb.config import RouterConfig
    from dplb.obs.metrics_tenant import TenantMetrics
    from dplb.router.exchange import Exchange
    from dplb.router.state import RouterState
    from dplb.tenants import TenantsConfig

TICK_S = 0.01  # how often a non-empty queue looks for room freed elsewhere (other processes) and for timeouts
_GRANTED, _GONE = "granted", "gone"


class WaitingRoom:
    """Room, the queued requests and their grants of one router process (module docstring). ``refund(ticket)``,
    ``prepare(ex, ticket)`` and ``observe(ticket, seconds)`` are the gate's: give a reservation back, make the body
    changes of a request let through, observe a queue wait."""

    def __init__(self, cfg: RouterConfig, state: RouterState, fq: FairQueue, config: TenantsConfig,
                 metrics: TenantMetrics, reject: Any, refund: Callable[[Ticket], None],
                 prepare: Callable[[Exchange, Ticket], None], observe: Callable[[Ticket, float], None]) -> None:
        self.cfg = cfg
        self.state = state
        self.fq = fq
        self.config = config  # the gate's tenants file (replaced on reload)
        self.metrics = metrics
        self.reject = reject  # dplb.router.attempt.Upstreams.reject
        self.refund = refund
        self.prepare = prepare
        self.observe = observe
        self.granted: dict[int, int] = collections.defaultdict(int)  # worker → granted, not yet acquired
        self.held: dict[int, int] = collections.defaultdict(int)  # worker → slots held for a tenant's next request
        self._ticker: asyncio.Task[None] | None = None
        self.closed = False

    # ---- room -------------------------------------------------------------------------------------------------
    def free(self) -> dict[int, int]:
        """Free slots per routable worker (module docstring); in panic, per worker of the panic set; {} when there
        are none."""
        st = self.state
        snap = st.snapshot()  # (one read of the segment for both)
        ks = st.routable_workers(True, snap)
        if not ks:
            return {}
        load = st.inflight_all()
        default = self.cfg.policy.max_queue
        granted = self.granted
        held = self.held
        return {k: (snap[k].max_num_seqs if snap is not None and snap[k].max_num_seqs > 0 else default)
                - load[k] - granted[k] - held[k] for k in ks}

    @staticmethod
    def best(free: dict[int, int], cannot: frozenset[int], held: int = 0) -> int | None:
        """The eligible worker with the most free slots, None when none has more than ``held`` (the slots kept
        for more urgent classes)."""
        best = max(((n, -k) for k, n in free.items() if k not in cannot), default=None)
        return -best[1] if best is not None and best[0] > held else None

    @staticmethod
    def steer(ex: Exchange, free: dict[int, int], held: int = 0) -> None:
        """Route the request among the workers with room (when one is left)."""
        req = ex.request
        full = frozenset(k for k, n in free.items() if n <= held)
        if full and any(k not in req.cannot_serve and k not in full for k in free):
            req.cannot_serve = req.cannot_serve | full

    def immediate(self, ex: Exchange, held: int) -> dict[int, int] | None:
        """:meth:`free` when ``ex``, arriving now, would be let through without waiting and without a held slot
        (the direct relay's test, before the gate takes anything: nothing is queued or held, and a worker it may go
        to has more than ``held`` free slots, or none is routable: the decision then answers it); None when it
        would not."""
        fq = self.fq
        if fq.length or fq.holding:
            return None
        free = self.free()
        return free if not free or self.best(free, ex.request.cannot_serve, held) is not None else None

    def claim(self, tenant: str) -> bool:
        """A request of ``tenant`` arrived: it takes a slot held for it (True) when there is one."""
        fq = self.fq
        k = fq.claim(tenant) if fq.holding else None
        if k is None:
            return False
        self.held[k] -= 1
        return True

    # ---- waiting ----------------------------------------------------------------------------------------------
    async def wait(self, ex: Exchange, tk: Ticket) -> bool:
        """Queue ``ex`` until it is granted a slot (True) or answered (False): module docstring."""
        fq = self.fq
        if self.closed:
            await self.reject(ex, RouterErrorKind.DRAINING_QUEUED, "the router is shutting down; retry on another "
                              "router", retry_after=self.cfg.retry_after_s)
            return False
        t = tk.tenant
        loop = asyncio.get_running_loop()
        fut = tk.fut = loop.create_future()
        w = tk.waiter = Waiter(t.name, t.weight, tk.rank, tk.est, tk, tk.expected)
        tk.cannot = ex.request.cannot_serve
        try:
            out = fq.push(w)
        except QueueRefusal as e:
            self.refund(tk)
            await self.reject(ex, e.kind, str(e), retry_after=self.cfg.retry_after_s)
            return False
        if out is not None:
            out.data.resolve(RouterErrorKind.QUEUE_SHARE_EXCEEDED)
        self.metrics.queued.labels(t.name).inc()
        t0 = time.perf_counter()
        hook: Any = (ex.scope.get("extensions") or {}).get(DISCONNECT_EXT)
        watcher = None
        if hook is not None:
            if hook.gone:
                tk.resolve(_GONE)
            hook.callback = lambda: tk.resolve(_GONE)
        else:
            watcher = asyncio.ensure_future(_watch(ex.receive, tk))
        self.pump()
        if not fut.done():
            self._start_ticker()
        try:
            got = await fut
        except BaseException:  # the server cancels the request (shutdown): leave nothing behind
            self._ungrant(tk)
            self.refund(tk)
            raise
        finally:
            self.metrics.queued.labels(t.name).dec()
            if hook is not None:
                hook.callback = None
            elif watcher is not None:
                watcher.cancel()
            fq.remove(w)  # still queued when its client left
        self.observe(tk, time.perf_counter() - t0)
        if got == _GRANTED:
            self._ungrant(tk)
            tk.charged = tk.expected  # charged by the queue's pop
            self.steer(ex, self.free(), self.config.held(tk.rank))
            self.prepare(ex, tk)
            return True
        self.refund(tk)  # never sent: its tokens go back to the bucket
        if got == _GONE:
            self._ungrant(tk)  # granted after its client left (the grant raced the disconnect): give it back
            ex.gone = True
            await self.reject(ex, RouterErrorKind.CLIENT_CLOSED, "the client left while its request was queued")
            return False
        kind: RouterErrorKind = got
        await self.reject(ex, kind, _MESSAGES[kind].format(tenant=t.name, timeout=self.cfg.queue_timeout_s),
                          retry_after=self.cfg.retry_after_s)
        return False

    def _ungrant(self, tk: Ticket) -> None:
        """A granted request reached its worker pick (or was cancelled): it no longer holds a granted slot."""
        k, tk.granted_to = tk.granted_to, None
        if k is not None:
            self.granted[k] -= 1

    # ---- granting -------------------------------------------------------------------------------------------
    def pump(self) -> None:
        """Grant queued requests as long as workers have room."""
        fq = self.fq
        if not fq.length:
            return
        free = self.free()
        if not free:
            return

        held = self.config.held
        slots = self.state.slots
        # A peer process's more urgent request goes first: leave it the slot (its tick takes it within TICK_S).
        peer = slots.peers_urgent() if slots is not None and slots.has_peers else None
        top = len(self.config.classes) if peer is None else peer

        def can(w: Waiter) -> bool:
            fut = w.data.fut
            return (w.rank <= top and fut is not None and not fut.done()
                    and self.best(free, w.data.cannot, held(w.rank)) is not None)

        while fq.length:
            w = fq.pop(can)
            if w is None:
                break
            tk: Ticket = w.data
            k = self.best(free, tk.cannot, held(w.rank))
            assert k is not None
            free[k] -= 1
            self.granted[k] += 1
            tk.granted_to = k
            tk.resolve(_GRANTED)
        self._share_urgent()

    def _share_urgent(self) -> None:
        """Publish this process's most urgent queued class to its router slot (router groups: :meth:`pump`)."""
        slots = self.state.slots
        if slots is not None:
            slots.publish_urgent(self.fq.top_rank())

    def _start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        """While requests wait or slots are held: time them out, and look for room every :data:`TICK_S`."""
        fq = self.fq
        while fq.length or fq.holding:
            self._share_urgent()
            await asyncio.sleep(TICK_S)
            for w, kind in fq.expire():
                w.data.resolve(kind)
            self._unhold(fq.expire_holds())
            self.pump()
        self._share_urgent()

    def _unhold(self, workers: list[int]) -> None:
        for k in workers:
            self.held[k] -= 1

    def anticipate(self, worker: int | None, tk: Ticket) -> None:
        """``tk``'s request ended on ``worker`` (None: none was picked): hold its slot for its tenant's next request
        when the fair queue says so."""
        fq = self.fq
        if not fq.length or not tk.relayed or worker is None:
            return
        t = tk.tenant
        if fq.anticipate(t.name, t.weight, tk.rank, tk.est, tk.expected, worker):
            self.held[worker] += 1
            self._start_ticker()

    def close(self) -> None:
        """The router stops: every queued request is answered 503 ``router_draining`` (none is left unanswered)."""
        self.closed = True
        fq = self.fq
        self._unhold(fq.expire_holds(every=True))
        for w in list(fq.order()):
            fq.remove(w)
            w.data.resolve(RouterErrorKind.DRAINING_QUEUED)


_MESSAGES = {
    RouterErrorKind.QUEUE_SHARE_EXCEEDED: "tenant {tenant} holds more than its share of the router's queue; retry "
                                          "later",
    RouterErrorKind.QUEUE_TIMEOUT: "no batch slot freed within --queue-timeout {timeout:g} s; retry later",
    RouterErrorKind.DRAINING_QUEUED: "the router is shutting down; retry on another router",
}


async def _watch(receive: Any, tk: Ticket) -> None:
    await until_disconnect(receive)
    tk.resolve(_GONE)


__all__ = ["TICK_S", "WaitingRoom"]
