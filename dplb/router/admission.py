"""The router's fair queue: which waiting request goes next when a worker has room (docs/DESIGN.md §15).

Contract (pure logic: no I/O, no event loop; the clock is injected so tests drive time)
- :class:`FairQueue` holds the requests that found no worker with room, bounded by ``max_len`` requests and
  ``timeout_s`` seconds each. :meth:`FairQueue.pop` takes the next one: the most urgent priority class first
  (rank 0), then within the class the tenant with the smallest Virtual Token Counter (ties: the tenant with fewer
  requests queued, then the older head), then that tenant's oldest request (FIFO within a tenant).
- Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024, Algorithm 2): a
  tenant's counter grows by ``(w_p · prompt tokens + w_q · generated tokens) / weight`` as it is served — the
  prompt and the expected output (the request's ``max_tokens``, the caller's estimate) when the request is
  dispatched (:meth:`FairQueue.pop`), generated tokens beyond that as they stream, and the difference to the
  engine's count at the end (:meth:`FairQueue.charge`, negative for a refund). Charging the expected output up
  front keeps requests that started together from all looking cheap until they end (a response that is not a
  stream shows no token before its end). Counter lift: a tenant that arrives with nothing queued is lifted to the
  smallest counter of the tenants that are queued (or, when none is, to the counter of the tenant that left the
  queue last), so idle time is not banked as credit. Work-conserving: :meth:`FairQueue.pop` skips a request no
  worker can take (``can_serve``) and takes the next one, and a lone tenant gets every slot.
- Anticipation (Iyer & Druschel, "Anticipatory scheduling", SOSP 2001; Linux BFQ's idling for synchronous
  queues): a tenant whose request ended less than ``anticipation_s`` ago is expected back (once per such request,
  until a request of it arrives). When a request ends while another tenant waits and the tenant the queue would
  serve next is one expected back with nothing queued (:meth:`FairQueue.anticipate`: a more urgent class than any
  queued, or in the class first by its counter), the freed slot is held for up to ``anticipation_s`` seconds for
  that tenant's next request, charged as a request of the cost of its last one. A request of the tenant arriving
  in time takes the slot without queueing (:meth:`FairQueue.claim`, the charge refunded as the request is charged
  its own); past the time the hold ends and is refunded (:meth:`FairQueue.expire_holds`), and the tenant is not
  expected back again until one of its requests arrives within ``anticipation_s`` of one of its requests ending.
  Why: equal requests that started together end together, so a closed-loop tenant (its clients send the next
  request when the last one ends) has nothing queued exactly when a batch's worth of slots frees at once; without
  holding, those slots all went to the other tenants and the lift erased the deficit, and weight 2 vs 1 got 1.1:1
  on 32 slots (docs/DESIGN.md §15). A held tenant counts as queued for the lift. ``anticipation_s`` 0 turns it off.
- Bounds. A request that arrives to a full queue: when another tenant holds more of the queue than its share
  (queued / weight larger than the arrival's tenant would hold), that tenant's newest request is pushed out and
  answered 429 ``queue_share_exceeded``; otherwise the arrival is refused: 429 when its tenant is over its share
  (queued > max_len · weight / Σ weights of the queued tenants and itself), else 503 ``queue_full``. A request
  past ``timeout_s`` is removed (:meth:`FairQueue.expire`): 429 when its tenant is over its share, else 503
  ``queue_timeout``. :meth:`FairQueue.remove` takes out a request whose client left (never sent).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from typing import Any

from dplb.errors import RouterErrorKind


class Waiter:
    """One request as the queue sees it: ``tenant`` (name), ``weight`` (> 0), ``rank`` (priority class, 0 = most
    urgent), ``prompt_tokens`` and ``output_tokens`` (the estimates charged when it is dispatched: the prompt from
    its size, the output from its ``max_tokens``), ``seq`` and ``t_enq`` (set by the
    queue: arrival order and clock seconds), ``data`` (the caller's)."""

    __slots__ = ("data", "output_tokens", "prompt_tokens", "rank", "seq", "t_enq", "tenant", "weight")

    def __init__(self, tenant: str, weight: float = 1.0, rank: int = 0, prompt_tokens: int = 0,
                 data: Any = None, output_tokens: int = 0) -> None:
        self.tenant = tenant
        self.weight = weight
        self.rank = rank
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.data = data
        self.seq = 0
        self.t_enq = 0.0


class QueueRefusal(Exception):
    """The queue refuses a request: ``kind`` is the error to answer (429 or 503, module docstring)."""

    def __init__(self, kind: RouterErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class FairQueue:
    """Priority classes × tenants × FIFO, ordered by the Virtual Token Counter (module docstring).
    ``classes``: how many priority classes; ``w_prompt`` / ``w_output``: token weights; ``clock``: seconds."""

    def __init__(self, classes: int, max_len: int, timeout_s: float, w_prompt: float = 1.0, w_output: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, anticipation_s: float = 0.0) -> None:
        self.max_len = max_len
        self.anticipation_s = anticipation_s
        self.timeout_s = timeout_s
        self.w_prompt = w_prompt
        self.w_output = w_output
        self.clock = clock
        self.counters: dict[str, float] = collections.defaultdict(float)
        self._classes: list[dict[str, collections.deque[Waiter]]] = [{} for _ in range(classes)]
        self._queued: dict[str, int] = collections.defaultdict(int)  # tenant → queued requests (all classes)
        self._weights: dict[str, float] = {}
        self._seq = 0
        self._last_left = 0.0
        self.length = 0
        # Anticipation: tenant → holds (deadline, charged cost, caller's data), oldest first; when its requests ended
        # last; tenants whose last hold expired unused.
        self._holds: dict[str, collections.deque[tuple[float, float, Any]]] = {}
        self._ended: dict[str, float] = {}
        self._late: set[str] = set()
        # tenant → (deadline, weight, rank, cost) of its requests that ended within anticipation_s, one per client not
        # back yet (oldest first)
        self._expect: dict[str, collections.deque[tuple[float, float, int, float]]] = {}
        self.holding = 0  # holds open, all tenants

    # ---- the Virtual Token Counter --------------------------------------------------------------------------
    def cost(self, weight: float, prompt_tokens: int = 0, output_tokens: int = 0) -> float:
        """What serving these tokens adds to the counter of a tenant of ``weight``: ``(w_p·prompt + w_q·output) /
        weight``."""
        return (self.w_prompt * prompt_tokens + self.w_output * output_tokens) / weight

    def charge(self, tenant: str, weight: float, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """Add served tokens to ``tenant``'s counter (:meth:`cost`)."""
        self.counters[tenant] += self.cost(weight, prompt_tokens, output_tokens)

    def arrive(self, tenant: str) -> None:
        """The counter lift for a request of ``tenant`` arriving (call for every request, queued or not, before
        :meth:`claim`); a tenant holding a slot counts as queued."""
        if tenant in self._late and self.clock() - self._ended.get(tenant, -1e18) <= self.anticipation_s:
            self._late.discard(tenant)  # its clients come back in time again
        q = self._expect.get(tenant)
        if q:
            q.popleft()  # one of its clients came back
        if self._queued.get(tenant) or tenant in self._holds:
            return
        active = [self.counters[t] for t, n in self._queued.items() if n]
        lift = min(active) if active else self._last_left
        if self.counters[tenant] < lift:
            self.counters[tenant] = lift

    # ---- anticipation (module docstring) ------------------------------------------------------------------------
    def anticipate(self, tenant: str, weight: float, rank: int, prompt_tokens: int, output_tokens: int,
                   data: Any) -> bool:
        """A request of ``tenant`` (class ``rank``, of these token counts) ended and freed a slot; True when the slot
        is to be held (``data``: the caller's, not None, given back by :meth:`claim` or :meth:`expire_holds`) for
        the tenant the queue would serve next when that is one whose client is expected back (a request of it ended
        within ``anticipation_s``, not followed by an arrival) with nothing queued, the hold charged as the cost of
        its request that ended. The ending tenant is expected back unless its last hold expired unused."""
        now = self.clock()
        self._ended[tenant] = now
        if self.anticipation_s <= 0:
            return False
        if tenant not in self._late:  # its client is expected back within anticipation_s
            entry = (now + self.anticipation_s, weight, rank, self.cost(weight, prompt_tokens, output_tokens))
            self._expect.setdefault(tenant, collections.deque()).append(entry)
        for t in list(self._expect):
            q = self._expect[t]
            while q and q[0][0] <= now:
                q.popleft()
            if not q:
                del self._expect[t]
        top = self.top_rank()
        best = min(((q[-1][2], self.counters[t], t) for t, q in self._expect.items()
                    if not self._queued.get(t) and len(q) > len(self._holds.get(t, ()))), default=None)
        if top is None or best is None:
            return False
        r, counter, t = best
        if r > top or (r == top and counter > min(self.counters[u] for u in self._classes[top])):
            return False
        cost = self._expect[t][-1][3]
        self.counters[t] += cost
        self._holds.setdefault(t, collections.deque()).append((now + self.anticipation_s, cost, data))
        self.holding += 1
        return True

    def claim(self, tenant: str) -> Any:
        """A request of ``tenant`` arrived (after :meth:`arrive`): end its oldest hold, refunding its charge (the
        request is charged its own when dispatched); the hold's data, or None when the tenant holds no slot."""
        q = self._holds.get(tenant)
        if not q:
            return None
        _, cost, data = q.popleft()
        if not q:
            del self._holds[tenant]
        self.counters[tenant] -= cost
        self.holding -= 1
        return data

    def expire_holds(self, every: bool = False) -> list[Any]:
        """End the holds past their time (``every``: all of them), refunded; their data. A tenant whose hold
        expired gets none until it comes back in time (module docstring)."""
        now = self.clock()
        out = []
        for tenant in list(self._holds):
            q = self._holds[tenant]
            while q and (every or q[0][0] <= now):
                _, cost, data = q.popleft()
                self.counters[tenant] -= cost
                if not every:
                    self._late.add(tenant)
                out.append(data)
            if not q:
                del self._holds[tenant]
        self.holding -= len(out)
        return out

    def resize(self, classes: int) -> None:
        """Change the number of priority classes (a reloaded tenants file); queued requests keep their order,
        those of a class that no longer exists move to the last one."""
        if classes == len(self._classes):
            return
        old = [w for cls in self._classes for q in cls.values() for w in q]
        self._classes = [{} for _ in range(classes)]
        for w in sorted(old, key=lambda w: w.seq):
            w.rank = min(w.rank, classes - 1)
            self._classes[w.rank].setdefault(w.tenant, collections.deque()).append(w)

    # ---- queueing ---------------------------------------------------------------------------------------------
    def over_share(self, tenant: str, weight: float, extra: int = 0) -> bool:
        """True when ``tenant`` (with ``extra`` more requests) holds more than its weighted share of the queue and
        another tenant is queued too."""
        others = {t for t, n in self._queued.items() if n and t != tenant}
        if not others:
            return False
        total = weight + sum(self._weights[t] for t in others)
        return self._queued.get(tenant, 0) + extra > self.max_len * weight / total

    def push(self, w: Waiter) -> Waiter | None:
        """Queue ``w`` (after :meth:`arrive`); returns the request pushed out to make room (answer it 429), or
        None. Raises :class:`QueueRefusal` when ``w`` itself is refused (module docstring)."""
        out = None
        if self.length >= self.max_len:
            victim = max((t for t, n in self._queued.items() if n), key=lambda t: self._queued[t] / self._weights[t])
            mine = (self._queued.get(w.tenant, 0) + 1) / w.weight
            if victim != w.tenant and mine <= self._queued[victim] / self._weights[victim]:
                out = self._newest(victim)
                self.remove(out)
            elif self.over_share(w.tenant, w.weight, 1):
                raise QueueRefusal(RouterErrorKind.QUEUE_SHARE_EXCEEDED, f"tenant {w.tenant} holds more than its "
                                   f"share of the router's queue ({self.max_len} requests); retry later")
            else:
                raise QueueRefusal(RouterErrorKind.QUEUE_FULL, f"the router's queue is full ({self.max_len} "
                                   "requests waiting for a batch slot); retry later")
        self._seq += 1
        w.seq, w.t_enq = self._seq, self.clock()
        self._weights[w.tenant] = w.weight
        self._classes[min(w.rank, len(self._classes) - 1)].setdefault(w.tenant, collections.deque()).append(w)
        self._queued[w.tenant] += 1
        self.length += 1
        return out

    def _newest(self, tenant: str) -> Waiter:
        for cls in reversed(self._classes):
            q = cls.get(tenant)
            if q:
                return q[-1]
        raise LookupError(tenant)

    def _take(self, cls: dict[str, collections.deque[Waiter]], w: Waiter) -> None:
        q = cls[w.tenant]
        q.remove(w)
        if not q:
            del cls[w.tenant]
        self._queued[w.tenant] -= 1
        if not self._queued[w.tenant]:
            del self._queued[w.tenant]
            self._last_left = self.counters[w.tenant]
        self.length -= 1

    def remove(self, w: Waiter) -> bool:
        """Take ``w`` out (its client left, or it was pushed out); False when it was not queued."""
        cls = self._classes[min(w.rank, len(self._classes) - 1)]
        q = cls.get(w.tenant)
        if not q or w not in q:
            return False
        self._take(cls, w)
        return True

    def _tenants(self, cls: dict[str, collections.deque[Waiter]]) -> list[str]:
        """A class's tenants in dequeue order: smallest counter, then fewest queued (a newcomer lifted to the
        others' counter goes first), then the oldest head."""
        return sorted(cls, key=lambda t: (self.counters[t], self._queued[t], cls[t][0].seq))

    def order(self) -> Iterator[Waiter]:
        """The queued requests in dequeue order of their tenants' heads (class, counter, arrival)."""
        for cls in self._classes:
            for tenant in self._tenants(cls):
                yield from cls[tenant]

    def top_rank(self) -> int | None:
        """The most urgent priority class with a request queued (0 = most urgent); None when the queue is empty."""
        return next((r for r, cls in enumerate(self._classes) if cls), None)

    def pop(self, can_serve: Callable[[Waiter], bool] = lambda w: True) -> Waiter | None:
        """Remove and return the next request some worker can take (``can_serve``), its prompt charged; None when
        none can be taken."""
        for cls in self._classes:
            for tenant in self._tenants(cls):
                for w in cls[tenant]:
                    if can_serve(w):
                        self.charge(w.tenant, w.weight, w.prompt_tokens, w.output_tokens)
                        self._take(cls, w)
                        return w
        return None

    def expire(self) -> list[tuple[Waiter, RouterErrorKind]]:
        """Remove every request queued longer than ``timeout_s``; each with the error to answer it."""
        now = self.clock()
        old = [w for cls in self._classes for q in cls.values() for w in q if now - w.t_enq >= self.timeout_s]
        out = []
        for w in old:
            kind = (RouterErrorKind.QUEUE_SHARE_EXCEEDED if self.over_share(w.tenant, w.weight)
                    else RouterErrorKind.QUEUE_TIMEOUT)
            self.remove(w)
            out.append((w, kind))
        return out

    def queued(self, tenant: str) -> int:
        """How many requests of ``tenant`` are queued."""
        return self._queued.get(tenant, 0)


__all__ = ["FairQueue", "QueueRefusal", "Waiter"]
