"""Helpers shared by the hardening tests: polling with deadlines, the sim engine's own endpoints over its socket,
and the soak script's launcher/load helpers (``scripts/soak.py``)."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import soak  # noqa: E402

LaunchedCluster = soak.LaunchedCluster
SteadyLoad = soak.SteadyLoad
Result = soak.Result
proc_stats = soak.proc_stats
fd_kinds = soak.fd_kinds
one_request = soak.one_request


INTERNALS = re.compile(r"Traceback|File \"|/root|/tmp/|/work/|/dev/shm|site-packages|\.py\b")


def assert_no_internals(text: str) -> None:
    """No stack trace, source file or internal path in a response body (AssertionError naming what leaked)."""
    m = INTERNALS.search(text)
    assert m is None, f"internal detail {m.group(0)!r} in {text[:300]!r}"


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, step_s: float = 0.02) -> Any:
    """Poll ``pred()`` until it returns something truthy (returned); AssertionError naming ``what`` on timeout."""
    t0 = time.monotonic()
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(step_s)


def sim_get(sock: str, path: str) -> httpx.Response:
    """``GET path`` on a worker's Unix socket (the sim engine's own endpoints)."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://worker", timeout=10) as c:
        return c.get(path)


def sim_aborts(sock: str) -> float:
    """``vllm:request_success_total{finished_reason="abort"}`` of the sim engine on ``sock``."""
    for line in sim_get(sock, "/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rpartition(" ")[2])
    return 0.0


def completion(i: int, max_tokens: int = 8, stream: bool | None = None, prompt: str = "") -> dict[str, Any]:
    """Request ``i``'s completion body: streamed every other request unless ``stream`` says, usage included."""
    s = (i % 2 == 0) if stream is None else stream
    b: dict[str, Any] = {"model": "dplb-sim", "prompt": prompt or f"request {i}", "max_tokens": max_tokens}
    if s:
        b.update(stream=True, stream_options={"include_usage": True})
    return b


def read(path: str) -> str:
    """The text of ``path`` (undecodable bytes replaced)."""
    with open(path, errors="replace") as f:
        return f.read()


def log_count(text: str, needle: str) -> int:
    """Lines of ``text`` containing ``needle``."""
    return sum(1 for line in text.splitlines() if needle in line)
