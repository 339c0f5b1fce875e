"""One request's tenant state (:class:`Ticket`, on :attr:`dplb.router.exchange.Exchange.tenant`), created and
ended by the tenant gate (``dplb.router.tenancy``).

Contract: the attempt calls :meth:`Ticket.head` once with the worker's response head it is about to relay (it may
add ``x-ratelimit-*`` headers and starts the usage meter for a 2xx) and :meth:`Ticket.chunk` on every body chunk
(it returns the bytes to relay: the meter may take out a usage event the client did not ask for, and it charges
the fair queue for output beyond the expected tokens as it is produced). Each attempt, when it is settled, sets
:attr:`Ticket.failed` from its outcome (the last one counts: a retried or resumed request that ended well is not
failed).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from dplb.router.usage import Meter

if TYPE_CHECKING:
    from dplb.router.admission import FairQueue, Waiter
    from dplb.router.limits import TenantLimits
    from dplb.tenants import Tenant


class Ticket:
    """One request's tenant state, on :attr:`Exchange.tenant`: ``tenant``, ``rank`` (class), the prompt-token
    estimate, the queue future, the usage meter and timings (perf_counter seconds)."""

    __slots__ = ("cannot", "charged", "counted", "est", "expected", "failed", "fq", "fut", "granted_to", "limits",
                 "meter", "quota", "rank", "relayed", "scale", "sse", "strip", "t_first", "tenant", "wait_s", "waiter")

    def __init__(self, fq: FairQueue | None, tenant: Tenant, rank: int, limits: TenantLimits | None) -> None:
        self.fq = fq  # the gate's fair queue (None without one), charged for output as it is produced
        self.tenant = tenant
        self.rank = rank
        self.limits = limits
        self.est = 0
        self.counted = False
        self.fut: asyncio.Future[Any] | None = None
        self.waiter: Waiter | None = None
        self.granted_to: int | None = None
        self.meter: Meter | None = None
        self.strip = False
        self.relayed = False  # the worker's response head was relayed
        self.cannot: frozenset[int] = frozenset()  # workers that cannot serve it (model, pinned response)
        self.charged = 0  # output tokens charged to the VTC so far (the expected output at dispatch, then events)
        self.expected = 0  # the request's output limit × its sequences, n / best_of (0 when it sets no limit)
        self.quota = 0  # tokens reserved in the tenant's tokens_per_min bucket (corrected when the request ends)
        self.scale = 1  # a router group's fallback for a tenant without a shared entry (dplb.router.group_quota)
        self.sse = False  # the relayed response is an event stream (its first body byte is the first token)
        self.t_first: float | None = None
        self.wait_s = 0.0
        # The client got a failure though the status may say 200: its stream was cut, or failed by the worker's own
        # error event (dplb.router.health.Outcome.failed of the last attempt).
        self.failed = False

    # ---- hooks of the attempt ------------------------------------------------------------------------------
    def head(self, status: int, headers: list[tuple[bytes, bytes]], sse: bool) -> None:
        """The worker's response head is about to be relayed: add ``x-ratelimit-*``, start metering."""
        if self.limits is not None and self.limits.any:
            headers += self.limits.headers()
        self.relayed = True
        self.sse = sse
        self.meter = Meter(sse, self.strip) if status < 300 else None

    def resolve(self, value: Any) -> None:
        """Answer the queue future (granted, gone, or a refusal kind) unless it is answered already."""
        fut = self.fut
        if fut is not None and not fut.done():
            fut.set_result(value)

    def chunk(self, data: bytes) -> bytes:
        """One body chunk about to be relayed; returns what to relay (:meth:`dplb.router.usage.Meter.chunk`)."""
        if self.t_first is None:
            self.t_first = time.perf_counter()
        m = self.meter
        if m is None:
            return data
        out = m.chunk(data)
        if m.events > self.charged and self.fq is not None:  # past the expected output: charge as produced
            self.fq.charge(self.tenant.name, self.tenant.weight, output_tokens=m.events - self.charged)
            self.charged = m.events
        return out

    def chunks(self, chunks: list[bytes]) -> list[bytes]:
        """:meth:`chunk` of each of ``chunks`` (one read of the worker's socket, the direct relay); returns what to
        relay: ``chunks`` itself, unless the meter takes the usage event out (:attr:`strip`: the router asked for
        it), then what :meth:`chunk` returned for each, the empty ones (an event not complete yet) left out."""
        if self.fq is not None:  # (the output charged as it is produced)
            if self.strip:
                return [out for data in chunks if (out := self.chunk(data))]
            for data in chunks:
                self.chunk(data)
            return chunks
        if self.t_first is None:
            self.t_first = time.perf_counter()
        m = self.meter
        if m is not None:
            for data in chunks:  # (one call per chunk: a stream's read is usually one)
                m.chunk(data)
        return chunks
