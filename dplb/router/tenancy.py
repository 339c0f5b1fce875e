"""The tenant gate of the proxy: who sent a request, whether it may run now, and what it used
(docs/DESIGN.md §15).

Contract
- Off unless a feature needs it (:attr:`Gate.on`: ``--tenants``, ``--api-key`` or ``--access-log``): then the proxy
  never calls the gate and a request carries no tenant state at all (no ticket, no usage meter on its chunks, no
  ``dplb_tenant_*`` sample); its tenant is ``default`` where one is shown (trace, ``/debug/decisions``).
- :attr:`Gate.plain`: on, without a tenants file (``--api-key`` or ``--access-log`` alone): one tenant,
  ``default``, with no limits, allow-list, stored-response owners or fair queue, so :meth:`Gate.enter` never refuses
  or waits: it is :meth:`Gate.admit`, synchronous.
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
  :class:`dplb.router.peek.Peek`); then, with a tenants file, the fair queue (:mod:`dplb.router.admission`): the
  request runs at once when it is alone (nothing queued, or a slot held for its tenant) and a worker has room
  (:mod:`dplb.router.waiting`: room, and the wait when there is none), else it waits in the router — never in the
  engines — until a freed slot is granted, it times out, it is pushed out, the router drains (503
  ``router_draining``), or its client leaves (499, nothing sent). Returns False when the request was answered (or
  its client left). Everything up to the wait is synchronous (:meth:`Gate._admission`).
- :meth:`Gate.admit_now`: the direct relay's admission (:mod:`dplb.router.direct`): :meth:`Gate.enter`'s own
  synchronous steps when they admit the request at once (the same ticket, reservation, counts, counter lift and
  charge, steering and body changes); else nothing is taken — not the rate limits' tokens, not the queue's counter
  lift — and False: the relay declines and the ASGI path runs :meth:`Gate.enter` (it answers a refusal, or queues
  the request). So on both paths a request admitted at once leaves the same tenant state, ledger and metrics.
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

import collections
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dplb.config import RouterConfig
from dplb.errors import ConfigError, RouterErrorKind
from dplb.obs.metrics_tenant import TenantMetrics, TenantsFileMetrics
from dplb.router.admission import FairQueue
from dplb.router.allowlist import model_refusal
from dplb.router.group_quota import GroupQuota
from dplb.router.limits import TenantLimits, concurrency_headers
from dplb.router.tenant_book import count_slo, limits_for, publish_slos, read_tenants
from dplb.router.ticket import Ticket
from dplb.router.usage import output_limit, sequences, with_fields
from dplb.router.waiting import WaitingRoom
from dplb.tenants import Tenant

if TYPE_CHECKING:
    from dplb.router.exchange import Exchange
    from dplb.router.models import ServedModels
    from dplb.router.ownership import OwnedResponseIds
    from dplb.router.state import RouterState

log = logging.getLogger("dplb.router.tenants")
BYTES_PER_TOKEN = 4  # prompt-token estimate at admission (OpenAI's rule of thumb for English text)
#: A refusal to answer: its error kind, message, Retry-After (seconds; None: ``--retry-after``) and extra headers.
Refusal = tuple[RouterErrorKind, str, int | None, Sequence[tuple[bytes, bytes]]]


def prompt_estimate(ex: Exchange) -> int:
    """The router's estimate of ``ex``'s prompt tokens (at least 1): the bytes of the body's prompt field, as sent
    (the raw JSON of ``messages`` for chat, ``prompt`` for completions, ``input`` otherwise:
    :meth:`dplb.router.proxy.Proxy.route_request`), else of the whole (decoded) body, ÷ :data:`BYTES_PER_TOKEN`."""
    return max(1, len(ex.request.prompt or ex.body) // BYTES_PER_TOKEN)


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
        #: The fair queue's waiting room (room, waiting, grants: :mod:`dplb.router.waiting`), with a tenants file.
        self.room = (WaitingRoom(cfg, state, self.fq, self.config, self.metrics, reject, self._refund, self._prepare,
                                 self._observe_wait) if self.fq is not None else None)
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
        if self.room is not None:
            self.room.config = tc
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
        is admitted at once; what :meth:`enter` does then, nothing else."""
        tk: Ticket = ex.tenant
        tk.est = prompt_estimate(ex)
        self.active[tk.tenant.name] += 1
        tk.counted = True
        self._observe_wait(tk, 0.0)

    def admit_now(self, ex: Exchange) -> bool:
        """The direct relay's admission (module docstring): ``ex`` (identified) admitted now, exactly as
        :meth:`enter` admits it (True), or nothing done (False: :meth:`enter` would refuse it or queue it)."""
        if self.plain:
            self.admit(ex)
            return True
        return self._admission(ex, True) is True

    async def enter(self, ex: Exchange) -> bool:
        """Admit ``ex`` now, after waiting, or answer it (module docstring). False when it was answered."""
        if self.plain:
            self.admit(ex)
            return True
        got = self._admission(ex, False)
        if got is True:
            return True
        if got is False:
            assert self.room is not None  # (only the fair queue waits)
            return await self.room.wait(ex, ex.tenant)
        kind, message, retry_after, headers = got
        await self.reject(ex, kind, message, retry_after=retry_after, extra_headers=headers)
        return False

    def _admission(self, ex: Exchange, lane: bool) -> bool | Refusal:
        """:meth:`enter`'s synchronous part: True (admitted now), False (counted, to wait in the fair queue) or the
        refusal to answer (nothing taken). ``lane`` (the direct relay): False before anything is taken when the
        request would wait, and a refusal takes nothing either (the ASGI path checks it again and answers)."""
        tk: Ticket = ex.tenant
        t = tk.tenant
        if t.models is not None or self.owners is not None:  # an allow-list; stored responses (--tenants)
            why = model_refusal(ex, t, self.models) if t.models is not None else None
            if why is None and self.owners is not None:
                why = self.owners.refusal(ex, t)
            if why is not None:
                return why[0], why[1], None, ()
        tk.est = prompt_estimate(ex)
        lim, fq, cap, peers = tk.limits, self.fq, t.max_concurrent, 0
        sl = self.state.slots  # (a process alone on the segment calls nothing of the group)
        grouped = sl is not None and sl.has_peers and self.group.grouped(t)
        if grouped:  # the router group's consumption of this tenant (a process alone reads nothing)
            peers, tk.scale = self.group.sync(t, lim)  # (what it debits is read once: a second call adds nothing)
            if cap is not None and tk.scale > 1:
                cap = max(1, cap // tk.scale)
        if cap is not None and self.active[t.name] + peers >= cap:
            return (RouterErrorKind.CONCURRENCY_LIMITED, f"tenant {t.name} has {cap} requests open (across the "
                    "router group), its max_concurrent; retry when one ends", self.cfg.retry_after_s,
                    concurrency_headers(cap, self.cfg.retry_after_s) + (lim.headers() if lim is not None else []))
        out, seqs = 0, 1
        if fq is not None or (lim is not None and lim.tokens is not None):  # only they need the output limit
            p = ex.peek  # decoded with the body (dplb.router.peek.Peek): no second parse
            out = output_limit(p.max_completion_tokens, p.max_tokens, p.max_output_tokens)
            seqs = sequences(p.n, p.best_of)  # every sequence may run to the output limit
            tk.expected = out * seqs
        room = self.room
        free = None  # (the lane's room, read once: nothing changes it before the request is admitted)
        if lane and room is not None and (free := room.immediate(ex, self.config.held(tk.rank))) is None:
            return False
        if lim is not None and lim.any:
            tk.quota = lim.estimate(tk.est, out, seqs)
            refused = lim.check(tk.quota, tk.scale)
            if refused is not None:
                tk.quota = 0
                return refused[0], f"tenant {t.name}: {refused[2]}", refused[1], lim.headers(refill=False)
            tk.quota *= tk.scale
        self.active[t.name] += 1
        tk.counted = True
        if grouped:
            self.group.publish(t, 1, tk.quota)
        if fq is None or room is None:
            self._prepare(ex, tk)
            self._observe_wait(tk, 0.0)
            return True
        fq.arrive(t.name)
        claimed = room.claim(t.name)  # a slot held for this tenant (anticipation)
        if free is None:
            free = room.free()
        held = self.config.held(tk.rank)
        if (claimed or fq.length == 0) and (not free or room.best(free, ex.request.cannot_serve, held) is not None):
            fq.charge(t.name, t.weight, tk.est, tk.expected)
            tk.charged = tk.expected
            room.steer(ex, free, held)
            self._prepare(ex, tk)
            self._observe_wait(tk, 0.0)
            return True
        return False

    def _refund(self, tk: Ticket) -> None:
        """A request that is answered before it was sent gives its reserved tokens back."""
        if tk.quota and tk.limits is not None:
            tk.limits.correct(-tk.quota)
            if self.group.grouped(tk.tenant):
                self.group.publish(tk.tenant, 0, -tk.quota)
            tk.quota = 0

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
        if self.room is not None:
            d = getattr(ex, "decision", None)  # unset when no worker was picked
            self.room.anticipate(d.worker if d is not None else None, tk)
            self.room.pump()

    def close(self) -> None:
        """The router stops: every queued request is answered 503 ``router_draining`` (none is left unanswered)."""
        if self.room is not None:
            self.room.close()



__all__ = ["Gate", "Ticket", "prompt_estimate"]
