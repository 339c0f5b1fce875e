"""The tenant gate of the proxy: who sent a request, whether it may run now, and what it used
(docs/DESIGN.md §15).

Contract
- Off unless a feature needs it (:attr:`Gate.on`: ``--tenants``, ``--api-key`` or ``--access-log``): then the proxy
  never calls the gate and a request carries no tenant state at all (no ticket, no usage meter on its chunks, no
  ``dplb_tenant_*`` sample); its tenant is ``default`` where one is shown (trace, ``/debug/decisions``).
- :attr:`Gate.plain`: on, without a tenants file (``--api-key`` or ``--access-log`` alone): one tenant,
  ``default``, with no limits, allow-list, stored-response owners or fair queue, so :meth:`Gate.enter` never refuses
  or waits: it is :meth:`Gate.admit`, synchronous, which the direct relay (:mod:`dplb.router.direct`) calls too
  (identify, admit, the ticket's head and chunks, leave: the same tenant state, ledger and metrics on both paths).
- :meth:`Gate.identify` (before the body is read): the tenant of ``Authorization: Bearer <key>``
  (:meth:`dplb.tenants.TenantsConfig.lookup`, constant time); False = answer 401. Without any key configured
  (no ``--tenants``, no ``--api-key``) every request is tenant ``default``. ``--api-key``'s key is tenant
  ``default`` too, with or without a tenants file.
- :meth:`Gate.enter` (after the body is read): 403 ``model_not_allowed`` outside the tenant's ``models``
  (:mod:`dplb.router.allowlist`: every proxied route that runs a model; a request naming none is checked against
  the worker's default model and routed only to workers whose default the tenant may use); 404/409 for a stored
  response of another tenant (:mod:`dplb.router.ownership`: ``GET /v1/responses/{id}``, cancel,
  ``previous_response_id``, a ``request_id`` already another tenant's); 429 for
  its ``max_concurrent`` and its rate limits (:mod:`dplb.router.limits`, exact ``Retry-After``; all three held for a
  router group as a whole: :mod:`dplb.router.group_quota`; ``tokens_per_min``
  reserves the prompt estimate plus the body's output limit times its sequences (``n``/``best_of``), 400
  ``tokens_exceed_quota`` when that exceeds the whole quota; both come from the body peek:
  :class:`dplb.router.peek.Peek`); then, with a
  tenants file, the fair queue (:mod:`dplb.router.admission`): the request runs at once when it is alone and a
  worker has room, else it waits in the router — never in the engines — until :meth:`_pump` grants it a freed
  slot, it times out, it is pushed out, the router drains (503 ``router_draining``), or its client leaves (499,
  nothing sent). Returns False when the request was answered (or its client left).
- Room (docs/DESIGN.md §15): worker ``k`` has ``max_num_seqs(k) − open(k) − granted(k)`` free slots, where
  ``open`` is every router process's in-flight requests to ``k`` (:meth:`RouterState.inflight_all`: running +
  waiting in the engine as far as DPLB sent them, plus those in transit), ``max_num_seqs`` is what the worker
  publishes (the policy's ``max_queue`` when it publishes none) and ``granted`` counts requests let out of the
  queue that have not reached :meth:`RouterState.acquire` yet. A request of class rank ``r`` sees room only in
  the free slots beyond :meth:`TenantsConfig.held` (``[priorities] reserve``, kept for the more urgent classes).
  A granted request is routed among the workers with room only. In panic (docs/DESIGN.md §5.1: no worker is
  routable and some are only on heartbeat probation, :meth:`RouterState.routable_workers` with ``panic``) the
  workers panic routing routes among count as routable here, with the same room: queued and new requests are
  granted and then routed in panic instead of waiting for the probation to end.
- With ``engine_priority`` the tenant's class rank is written into the body's ``priority`` field (vLLM: lower
  runs first; needs ``--scheduling-policy priority``), only when the body has no ``priority`` of its own.
- :meth:`Gate.leave` (every exit path): the ledger (:class:`dplb.obs.metrics_tenant.TenantMetrics`: the engine's
  usage when the response carried it; else, once the worker's response head was relayed (the engine took the
  request and ran its prefill: a stream the client cancelled, or one that failed after it began), the router's
  prompt estimate and the generated events relayed), the VTC and token
  bucket corrections from the engine's usage (:mod:`dplb.router.usage`; without one, the token reservation is
  corrected to the prompt estimate plus the generated events relayed; a request answered while queued gives its
  whole reservation back), then the queue is pumped. TTFT (histogram and SLO) is observed for streamed responses
  only: the first body byte of any other response is the whole answer (its latency is the E2E histogram).
- :meth:`Gate.reload` (SIGHUP): a new tenants file replaces the old one between two requests; queued and running
  requests keep their tenant; a file that does not load keeps the old one and logs why.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING, Any

from dplb.config import RouterConfig
from dplb.errors import ConfigError, RouterErrorKind
from dplb.obs.metrics_tenant import TenantMetrics, TenantsFileMetrics
from dplb.router.admission import FairQueue, QueueRefusal, Waiter
from dplb.router.allowlist import model_refusal
from dplb.router.group_quota import GroupQuota
from dplb.router.limits import TenantLimits, concurrency_headers
from dplb.router.tenant_book import count_slo, limits_for, publish_slos, read_tenants
from dplb.router.ticket import Ticket
from dplb.router.usage import output_limit, sequences, with_fields
from dplb.runtime.asgi import until_disconnect
from dplb.runtime.serving import DISCONNECT_EXT
from dplb.tenants import Tenant

if TYPE_CHECKING:
    from dplb.router.exchange import Exchange
    from dplb.router.models import ServedModels
    from dplb.router.ownership import OwnedResponseIds
    from dplb.router.state import RouterState

log = logging.getLogger("dplb.router.tenants")
TICK_S = 0.01  # how often a non-empty queue looks for room freed elsewhere (other processes) and for timeouts
BYTES_PER_TOKEN = 4  # prompt-token estimate at admission (OpenAI's rule of thumb for English text)


def prompt_estimate(ex: Exchange) -> int:
    """The router's estimate of ``ex``'s prompt tokens (at least 1): the bytes of the body's prompt field, as sent
    (the raw JSON of ``messages`` for chat, ``prompt`` for completions, ``input`` otherwise:
    :meth:`dplb.router.proxy.Proxy.route_request`), else of the whole (decoded) body, ÷ :data:`BYTES_PER_TOKEN`."""
    return max(1, len(ex.request.prompt or ex.body) // BYTES_PER_TOKEN)
_GRANTED, _GONE = "granted", "gone"
_USAGE_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})


class Gate:
    """Tenants, limits, fair queue and ledger of one router process (module docstring)."""

    def __init__(self, cfg: RouterConfig, state: RouterState, registry: Any, reject: Any,
                 models: ServedModels, owners: OwnedResponseIds | None = None) -> None:
        self.cfg = cfg
        self.state = state
        self.models = models  # the workers' served and default models (allow-lists, model-less requests)
        self.owners = owners  # each stored response's tenant (with a tenants file)
        self.reject = reject  # dplb.router.attempt.Upstreams.reject
        #: Whether requests go through the gate (module docstring): a tenants file, an API key or the access log.
        self.on = cfg.tenants_file is not None or bool(cfg.api_key) or cfg.access_log
        #: On without a tenants file: admission never refuses or waits (module docstring, :meth:`admit`).
        self.plain = self.on and cfg.tenants_file is None
        self.metrics = TenantMetrics(registry)
        self.file_metrics = TenantsFileMetrics(registry) if cfg.tenants_file is not None else None
        self.config = read_tenants(cfg, self.file_metrics, starting=True)
        self._keyless = not any(t.key_sha256 for t in self.config.tenants)  # (no key: the first tenant)
        self.fq: FairQueue | None = None
        if cfg.tenants_file is not None:
            self.fq = FairQueue(len(self.config.classes), cfg.queue_max, cfg.queue_timeout_s,
                                self.config.prompt_token_weight, self.config.output_token_weight,
                                anticipation_s=self.config.anticipation_s)
        self._limits: dict[str, TenantLimits] = limits_for(self.config, {})
        self.active: dict[str, int] = collections.defaultdict(int)
        self.group = GroupQuota(state, self.active)  # the limits shared by the router group
        self.group.configure(self.config)
        self._granted: dict[int, int] = collections.defaultdict(int)
        self._held: dict[int, int] = collections.defaultdict(int)  # worker → slots held for a tenant's next request
        self._ticker: asyncio.Task[None] | None = None
        self.closed = False
        publish_slos(self.metrics, self.config)

    # ---- configuration ----------------------------------------------------------------------------------------
    def reload(self) -> bool:
        """Read the tenants file again (SIGHUP). False (and a log line) when it does not load: the old one stays."""
        if self.cfg.tenants_file is None:
            log.info("SIGHUP: no --tenants file to reload")
            return False
        try:
            tc = read_tenants(self.cfg, self.file_metrics)
        except ConfigError as e:
            log.error("tenants file not reloaded, keeping the previous one: %s", e)
            return False
        self.config = tc
        self._keyless = not any(t.key_sha256 for t in tc.tenants)
        self._limits = limits_for(tc, self._limits)
        self.group.configure(tc)
        publish_slos(self.metrics, tc)
        if self.fq is not None:
            self.fq.resize(len(tc.classes))
            self.fq.w_prompt, self.fq.w_output = tc.prompt_token_weight, tc.output_token_weight
            self.fq.anticipation_s = tc.anticipation_s
        log.info("tenants file %s reloaded: %s", tc.path, tc.summary())
        return True

    # ---- identification -----------------------------------------------------------------------------------------
    def tenant_of(self, authorization: bytes) -> Tenant | None:
        """The tenant of an ``Authorization`` header value (module docstring), or None (answer 401)."""
        tc = self.config
        if self._keyless:
            return tc.tenants[0]
        if authorization[:7].lower() != b"bearer ":
            return None
        return tc.lookup(authorization[7:].strip())

    def identify(self, ex: Exchange, authorization: bytes) -> bool:
        """Set ``ex.tenant`` from the header; False when no tenant has that key."""
        t = self.tenant_of(authorization)
        if t is None:
            return False
        ex.tenant = Ticket(self.fq, t, self.config.rank(t.priority), self._limits.get(t.name))
        ex.trace.tenant(t.name)
        return True

    # ---- admission ----------------------------------------------------------------------------------------------
    def admit(self, ex: Exchange) -> None:
        """:meth:`enter` of a :attr:`plain` gate (its tenant has no limit, allow-list or queue): ``ex`` (identified)
        is admitted at once; what :meth:`enter` does then, nothing else (the direct relay's admission)."""
        tk: Ticket = ex.tenant
        tk.est = prompt_estimate(ex)
        self.active[tk.tenant.name] += 1
        tk.counted = True
        self._observe_wait(tk, 0.0)

    async def enter(self, ex: Exchange) -> bool:
        """Admit ``ex`` now, after waiting, or answer it (module docstring). False when it was answered."""
        if self.plain:
            self.admit(ex)
            return True
        tk: Ticket = ex.tenant
        t = tk.tenant
        if t.models is not None or self.owners is not None:  # an allow-list; stored responses (--tenants)
            why = model_refusal(ex, t, self.models) if t.models is not None else None
            if why is None and self.owners is not None:
                why = self.owners.refusal(ex, t)
            if why is not None:
                await self.reject(ex, *why)
                return False
        tk.est = prompt_estimate(ex)
        lim, fq, cap, peers = tk.limits, self.fq, t.max_concurrent, 0
        sl = self.state.slots  # (a process alone on the segment calls nothing of the group)
        grouped = sl is not None and sl.has_peers and self.group.grouped(t)
        if grouped:  # the router group's consumption of this tenant (a process alone reads nothing)
            peers, tk.scale = self.group.sync(t, lim)
            if cap is not None and tk.scale > 1:
                cap = max(1, cap // tk.scale)
        if cap is not None and self.active[t.name] + peers >= cap:
            await self.reject(ex, RouterErrorKind.CONCURRENCY_LIMITED, f"tenant {t.name} has {cap} requests open "
                              "(across the router group), its max_concurrent; retry when one ends",
                              retry_after=self.cfg.retry_after_s,
                              extra_headers=concurrency_headers(cap, self.cfg.retry_after_s)
                              + (tk.limits.headers() if tk.limits is not None else []))
            return False
        out, seqs = 0, 1
        if fq is not None or (lim is not None and lim.tokens is not None):  # only they need the output limit
            p = ex.peek  # decoded with the body (dplb.router.peek.Peek): no second parse
            out = output_limit(p.max_completion_tokens, p.max_tokens, p.max_output_tokens)
            seqs = sequences(p.n, p.best_of)  # every sequence may run to the output limit
            tk.expected = out * seqs
        if lim is not None and lim.any:
            tk.quota = lim.estimate(tk.est, out, seqs)
            refused = lim.check(tk.quota, tk.scale)
            if refused is not None:
                tk.quota = 0
                await self.reject(ex, refused[0], f"tenant {t.name}: {refused[2]}", retry_after=refused[1],
                                  extra_headers=lim.headers(refill=False))
                return False
            tk.quota *= tk.scale
        self.active[t.name] += 1
        tk.counted = True
        if grouped:
            self.group.publish(t, 1, tk.quota)
        if fq is None:
            self._prepare(ex, tk)
            self._observe_wait(tk, 0.0)
            return True
        fq.arrive(t.name)
        claimed = fq.claim(t.name) if fq.holding else None  # a slot held for this tenant (anticipation)
        if claimed is not None:
            self._held[claimed] -= 1
        free = self._free()
        held = self.config.held(tk.rank)
        if ((claimed is not None or fq.length == 0)
                and (not free or self._best(free, ex.request.cannot_serve, held) is not None)):
            fq.charge(t.name, t.weight, tk.est, tk.expected)
            tk.charged = tk.expected
            self._steer(ex, free, held)
            self._prepare(ex, tk)
            self._observe_wait(tk, 0.0)
            return True
        return await self._wait(ex, tk)

    async def _wait(self, ex: Exchange, tk: Ticket) -> bool:
        fq = self.fq
        assert fq is not None
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
            self._refund(tk)
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
        self._pump()
        if not fut.done():
            self._start_ticker()
        try:
            got = await fut
        except BaseException:  # the server cancels the request (shutdown): leave nothing behind
            self._ungrant(tk)
            self._refund(tk)
            raise
        finally:
            self.metrics.queued.labels(t.name).dec()
            if hook is not None:
                hook.callback = None
            elif watcher is not None:
                watcher.cancel()
            fq.remove(w)  # still queued when its client left
        self._observe_wait(tk, time.perf_counter() - t0)
        if got == _GRANTED:
            self._ungrant(tk)
            tk.charged = tk.expected  # charged by the queue's pop
            self._steer(ex, self._free(), self.config.held(tk.rank))
            self._prepare(ex, tk)
            return True
        self._refund(tk)  # never sent: its tokens go back to the bucket
        if got == _GONE:
            self._ungrant(tk)  # granted after its client left (the grant raced the disconnect): give it back
            ex.gone = True
            await self.reject(ex, RouterErrorKind.CLIENT_CLOSED, "the client left while its request was queued")
            return False
        kind: RouterErrorKind = got
        await self.reject(ex, kind, _MESSAGES[kind].format(tenant=t.name, timeout=self.cfg.queue_timeout_s),
                          retry_after=self.cfg.retry_after_s)
        return False

    def _refund(self, tk: Ticket) -> None:
        """A request that is answered before it was sent gives its reserved tokens back."""
        if tk.quota and tk.limits is not None:
            tk.limits.correct(-tk.quota)
            if self.group.grouped(tk.tenant):
                self.group.publish(tk.tenant, 0, -tk.quota)
            tk.quota = 0

    def _ungrant(self, tk: Ticket) -> None:
        """A granted request reached its worker pick (or was cancelled): it no longer holds a granted slot."""
        k, tk.granted_to = tk.granted_to, None
        if k is not None:
            self._granted[k] -= 1

    def _observe_wait(self, tk: Ticket, seconds: float) -> None:
        tk.wait_s = seconds
        self.metrics.ledger(tk.tenant.name, tk.tenant.priority).wait(seconds)

    def _prepare(self, ex: Exchange, tk: Ticket) -> None:
        """The body changes the gate makes on a request it lets through (module docstring)."""
        fields = []
        route = ex.route
        if self.cfg.engine_priority and b'"priority"' not in ex.body:
            fields.append(b'"priority":%d' % tk.rank)
        if (self.fq is not None and ex.peek.stream is True and route is not None and route.path in _USAGE_ROUTES
                and b'"stream_options"' not in ex.body):
            fields.append(b'"stream_options":{"include_usage":true}')
            tk.strip = True
        if fields and ex.body.lstrip().startswith(b"{"):
            ex.body = with_fields(ex.body, b",".join(fields))

    # ---- room -------------------------------------------------------------------------------------------------
    def _free(self) -> dict[int, int]:
        """Free slots per routable worker (module docstring); in panic, per worker of the panic set (module
        docstring); {} when there are none."""
        st = self.state
        ks = st.routable_workers(panic=True)
        if not ks:
            return {}
        snap = st.snapshot()
        load = st.inflight_all()
        default = self.cfg.policy.max_queue
        granted = self._granted
        held = self._held
        return {k: (snap[k].max_num_seqs if snap is not None and snap[k].max_num_seqs > 0 else default)
                - load[k] - granted[k] - held[k] for k in ks}

    @staticmethod
    def _best(free: dict[int, int], cannot: frozenset[int], held: int = 0) -> int | None:
        """The eligible worker with the most free slots, None when none has more than ``held`` (the slots kept
        for more urgent classes)."""
        best = max(((n, -k) for k, n in free.items() if k not in cannot), default=None)
        return -best[1] if best is not None and best[0] > held else None

    @staticmethod
    def _steer(ex: Exchange, free: dict[int, int], held: int = 0) -> None:
        """Route the request among the workers with room (when one is left)."""
        req = ex.request
        full = frozenset(k for k, n in free.items() if n <= held)
        if full and any(k not in req.cannot_serve and k not in full for k in free):
            req.cannot_serve = req.cannot_serve | full

    def _pump(self) -> None:
        """Grant queued requests as long as workers have room."""
        fq = self.fq
        if fq is None or not fq.length:
            return
        free = self._free()
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
                    and self._best(free, w.data.cannot, held(w.rank)) is not None)

        while fq.length:
            w = fq.pop(can)
            if w is None:
                break
            tk: Ticket = w.data
            k = self._best(free, tk.cannot, held(w.rank))
            assert k is not None
            free[k] -= 1
            self._granted[k] += 1
            tk.granted_to = k
            tk.resolve(_GRANTED)
        self._share_urgent()

    def _share_urgent(self) -> None:
        """Publish this process's most urgent queued class to its router slot (router groups: :meth:`_pump`)."""
        slots = self.state.slots
        if slots is not None and self.fq is not None:
            slots.publish_urgent(self.fq.top_rank())

    def _start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        """While requests wait or slots are held: time them out, and look for room every :data:`TICK_S`."""
        fq = self.fq
        assert fq is not None
        while fq.length or fq.holding:
            self._share_urgent()
            await asyncio.sleep(TICK_S)
            for w, kind in fq.expire():
                w.data.resolve(kind)
            self._unhold(fq.expire_holds())
            self._pump()
        self._share_urgent()

    def _unhold(self, workers: list[int]) -> None:
        for k in workers:
            self._held[k] -= 1

    def _anticipate(self, ex: Exchange, tk: Ticket) -> None:
        """``ex`` ended on a worker: hold its slot for its tenant's next request when the fair queue says so."""
        fq = self.fq
        if fq is None or not fq.length or not tk.relayed:
            return
        d = getattr(ex, "decision", None)  # unset when no worker was picked
        k = d.worker if d is not None else None
        if k is None:
            return
        t = tk.tenant
        if fq.anticipate(t.name, t.weight, tk.rank, tk.est, tk.expected, k):
            self._held[k] += 1
            self._start_ticker()

    def leave(self, ex: Exchange) -> None:
        """``ex`` ended (any way): ledger, corrections, and the next queued request (module docstring)."""
        tk: Ticket | None = ex.tenant
        if tk is None:
            return
        t = tk.tenant
        if tk.counted:
            self.active[t.name] -= 1
        m = tk.meter
        returned = 0  # tokens the correction below gives back (negative: takes)
        usage = m.finish() if m is not None else None
        c = self.metrics.ledger(t.name, t.priority)
        if usage is not None:
            completion = usage.completion_tokens or 0
            c.prompt.inc(usage.prompt_tokens)
            c.completion.inc(completion)
            c.cached.inc(usage.cached)
            if self.fq is not None:
                self.fq.charge(t.name, t.weight, usage.prompt_tokens - tk.est, completion - tk.charged)
        elif tk.relayed or (m is not None and m.events):  # no engine count (cancelled, failed mid-stream)
            c.prompt.inc(tk.est)  # the engine took the request and ran its prefill: the router's estimate
            c.completion.inc(m.events if m is not None else 0)
        if tk.quota and tk.limits is not None:  # the reservation becomes the engine's count (else what was seen)
            used = (usage.prompt_tokens + (usage.completion_tokens or 0) if usage is not None
                    else tk.est + (m.events if m is not None else 0))
            returned = tk.quota - used * tk.scale
            tk.limits.correct(-returned)
            tk.quota = 0
        if tk.counted and (sl := self.state.slots) is not None and sl.has_peers and self.group.grouped(t):
            self.group.publish(t, 0, -returned)
        if usage is None and self.fq is not None and tk.charged:  # no engine count: keep what was seen produced
            self.fq.charge(t.name, t.weight, 0, (m.events if m is not None else 0) - tk.charged)
        status = ex.status
        outcome = ("cancelled" if ex.gone or status in (0, 499) else "server_error" if status >= 500 or tk.failed
                   else "ok" if status < 400 else "rejected" if status in (401, 403, 429) and not tk.relayed
                   else "client_error")
        c.request(outcome)
        end = time.perf_counter()
        ttft = tk.t_first - ex.t_start if tk.t_first is not None and tk.sse else None  # streams only
        if ttft is not None:
            c.first_token(ttft)
        count_slo(self.metrics, self.config, t, outcome, ttft)
        if outcome == "ok":
            c.end_to_end(end - ex.t_start)
        if self.cfg.access_log:
            log.info("%s tenant=%s status=%d outcome=%s queue_wait_ms=%.0f prompt_tokens=%s completion_tokens=%s",
                     ex.rid.decode(), t.name, status, outcome, tk.wait_s * 1000,
                     usage.prompt_tokens if usage else "-", (usage.completion_tokens if usage else None) or "-")
        self._anticipate(ex, tk)
        self._pump()

    def close(self) -> None:
        """The router stops: every queued request is answered 503 ``router_draining`` (none is left unanswered)."""
        self.closed = True
        fq = self.fq
        if fq is None:
            return
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


__all__ = ["Gate", "Ticket", "prompt_estimate"]
