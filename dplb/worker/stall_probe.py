"""A worker's own engine probe: an engine that recovers from a stall shows progress without waiting for traffic.

Contract (docs/DESIGN.md §6)
- The stall check (:class:`dplb.policy.stall.StallDetector`, in the collector and in the routers) lifts a stall
  only when the engine's progress moves, and an idle engine makes none: without a request the stall flag
  (``FLAG_STALLED``, ``dplb_worker_stalled``) would stay set on a healthy idle worker until traffic came, and no
  traffic comes to a host whose every worker is stalled (it reports itself not ready).
- So while the collector says a probe is due (:attr:`dplb.worker.collector.Collector.probe_due`: no router
  request on the worker, and stalled, or suspect: its last requests left without progress, e.g. a router's stall
  check failed them before the worker's own check saw the stall), :class:`StallProbe` sends the engine **one**
  request at a time, the warm-up's (``max_tokens: 1``, through the worker's own socket). Two probes start at least
  ``stall_after_s`` apart; each is bounded by ``stall_after_s`` + :data:`TIMEOUT_TICKS` state intervals, so that
  the worker's own check, which counts the probe in flight as an outstanding request
  (:attr:`dplb.worker.collector.Collector.own_probes`), finds a probe without progress stalled before the probe
  gives up. The client leaves at the timeout and the engine drops the request like any whose client left. A probe
  pending when the engine resumes is served at once, so the stall lifts within a state interval or two of the
  engine's recovery; at worst within ``stall_after_s`` + a few intervals.
- Its answer is not looked at: the progress it makes is what lifts the stall, in the collector and in every router
  (each reads the slot). It counts among the worker's requests (``requests_total``) like the warm-up does.
- One log line when probing begins (per stall) and one when a probe is answered; no exception escapes
  :meth:`StallProbe.run` but cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final, Protocol

import httpx

log = logging.getLogger("dplb.worker")
#: A probe's timeout past ``stall_after_s``, in state intervals: the collector's check starts the probe's debt at
#: its next tick (≤ 1 interval) and finds it stalled at the first tick past ``stall_after_s`` (≤ 1 more); one spare.
TIMEOUT_TICKS: Final = 3


class ProbeBook(Protocol):
    """Where the probe learns it is due and tells that one is in flight (:class:`dplb.worker.collector.Collector`)."""

    probe_due: bool
    own_probes: int


class StallProbe:
    """Probes the engine of worker ``worker_id`` on Unix socket ``uds`` while ``book.probe_due`` (module
    docstring). ``model``: the served model name to ask for; ``stall_after_s`` > 0: the stall check's threshold,
    seconds; ``interval_s`` > 0: the state interval (how often the book is read), seconds."""

    def __init__(self, worker_id: int, uds: str, model: str, book: ProbeBook, stall_after_s: float,
                 interval_s: float) -> None:
        if stall_after_s <= 0 or interval_s <= 0:
            raise ValueError(f"stall_after_s and interval_s must be > 0, got {stall_after_s}, {interval_s}")
        self.worker_id = worker_id
        self.uds = uds
        self.model = model
        self.book = book
        self.gap_s = stall_after_s
        self.timeout_s = stall_after_s + TIMEOUT_TICKS * interval_s
        self.interval_s = interval_s
        self.sent = 0  # probes sent in total
        self.answered = 0  # probes the engine answered 200

    async def run(self) -> None:
        """Probe while due, until cancelled."""
        transport = httpx.AsyncHTTPTransport(uds=self.uds)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=self.timeout_s) as client:
            probing = False
            last = -self.gap_s
            while True:
                await asyncio.sleep(self.interval_s)
                if not self.book.probe_due:
                    probing = False
                    continue
                if time.monotonic() - last < self.gap_s:
                    continue
                if not probing:
                    probing = True
                    log.warning("Worker %d: no engine progress and no request on it; probing the engine with one "
                                "1-token request at a time (each bounded by %g s) until its progress resumes",
                                self.worker_id, self.timeout_s)
                last = time.monotonic()
                await self._probe(client, last)

    async def _probe(self, client: httpx.AsyncClient, t0: float) -> None:
        """Send one probe and wait for it (at most ``timeout_s``), counted in flight meanwhile; log an answer."""
        self.sent += 1
        body = {"model": self.model, "prompt": "stall probe", "max_tokens": 1}
        self.book.own_probes += 1
        try:
            r = await client.post("/v1/completions", json=body)
        except httpx.HTTPError:  # the timeout: the engine is still stuck (the next probe follows)
            return
        finally:
            self.book.own_probes -= 1
        if r.status_code == 200:
            self.answered += 1
            log.warning("Worker %d: the engine answered a stall probe in %.1f s", self.worker_id,
                        time.monotonic() - t0)


__all__ = ["TIMEOUT_TICKS", "ProbeBook", "StallProbe"]
