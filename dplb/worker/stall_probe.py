"""A stalled worker's own engine probe: an engine that recovers shows progress without waiting for traffic.

Contract (docs/DESIGN.md §6)
- The stall check (:class:`dplb.policy.stall.StallDetector`, in the collector and in the routers) lifts a stall
  only when the engine's progress moves, and an idle engine makes none: without a request the stall flag
  (``FLAG_STALLED``, ``dplb_worker_stalled``) would stay set on a healthy idle worker until traffic came, and no
  traffic comes to a host whose every worker is stalled (it reports itself not ready).
- So while ``due()`` says so (the collector's :attr:`dplb.worker.collector.Collector.stalled_idle`: stalled, no
  router request on the worker), :class:`StallProbe` sends its engine **one** request at a time, the warm-up's
  (``max_tokens: 1``, through the worker's own socket), each bounded by ``timeout_s`` (the stack's
  ``--stall-after``): a still-stuck engine gets at most one such request per ``timeout_s``; the client leaves at the
  timeout, and the engine drops it like any request whose client left. A probe pending when the engine resumes is
  served at once, so the stall lifts within a state interval or two of the engine's recovery.
- Its answer is not looked at: the progress it makes is what lifts the stall, in the collector and in every router
  (each reads the slot). It counts among the worker's requests (``requests_total``) like the warm-up does.
- One log line when probing begins (per stall) and one when a probe is answered; no exception escapes
  :meth:`StallProbe.run` but cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

log = logging.getLogger("dplb.worker")


class StallProbe:
    """Probes the engine of worker ``worker_id`` on Unix socket ``uds`` while ``due()`` (module docstring).
    ``model``: the served model name to ask for; ``timeout_s`` > 0: each probe's bound and the least time between
    the starts of two probes, seconds; ``check_s`` > 0: how often ``due()`` is asked, seconds."""

    def __init__(self, worker_id: int, uds: str, model: str, due: Callable[[], bool], timeout_s: float,
                 check_s: float) -> None:
        if timeout_s <= 0 or check_s <= 0:
            raise ValueError(f"timeout_s and check_s must be > 0, got {timeout_s}, {check_s}")
        self.worker_id = worker_id
        self.uds = uds
        self.model = model
        self.due = due
        self.timeout_s = timeout_s
        self.check_s = check_s
        self.sent = 0  # probes sent in total
        self.answered = 0  # probes the engine answered 200

    async def run(self) -> None:
        """Probe while due, until cancelled."""
        transport = httpx.AsyncHTTPTransport(uds=self.uds)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=self.timeout_s) as client:
            probing = False
            last = -self.timeout_s
            while True:
                await asyncio.sleep(self.check_s)
                if not self.due():
                    probing = False
                    continue
                if time.monotonic() - last < self.timeout_s:
                    continue
                if not probing:
                    probing = True
                    log.warning("Worker %d: engine stalled and no request on it; probing it with one 1-token "
                                "request at a time (each bounded by %g s) until its progress resumes",
                                self.worker_id, self.timeout_s)
                last = time.monotonic()
                await self._probe(client, last)

    async def _probe(self, client: httpx.AsyncClient, t0: float) -> None:
        """Send one probe and wait for it (at most ``timeout_s``); log an answer."""
        self.sent += 1
        body = {"model": self.model, "prompt": "stall probe", "max_tokens": 1}
        try:
            r = await client.post("/v1/completions", json=body)
        except httpx.HTTPError:  # the timeout: the engine is still stuck (the next probe follows)
            return
        if r.status_code == 200:
            self.answered += 1
            log.warning("Worker %d: the engine answered a stall probe in %.1f s", self.worker_id,
                        time.monotonic() - t0)


__all__ = ["StallProbe"]
