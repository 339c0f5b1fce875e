"""Micro-benchmark: the per-request CPU cost of a tenant's ``tokens_per_min`` at admission and at the end
(docs/DESIGN.md §15, :mod:`dplb.router.limits`).

Times, with timeit (``--repeat`` runs of ``--number`` requests each, the median per request in ns), for chat
bodies of about 300 B, 4 KiB and 64 KiB:

- ``peek``: the router's body peek (:class:`dplb.router.peek.Peek`, decoded for every JSON request), which now
  also decodes ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens``; ``peek (before)`` is the same
  struct without those three fields — the cost every request pays, quota or not;
- ``quota``: what the tenant gate adds for a tenant with ``tokens_per_min``: :func:`output_limit` from the peek,
  :meth:`TenantLimits.estimate`, :meth:`TenantLimits.check` (which takes the reservation) and
  :meth:`TenantLimits.correct` (the engine's usage at the end); ``quota (before)`` is the prompt-only check the
  gate did before reservations (``check`` + ``correct``). A tenant without ``tokens_per_min`` (and without the fair
  queue) runs none of it.

The bucket's rate is large so every request is admitted. Usage:
``python benchmarks/bench_quota.py [--repeat 15] [--number 20000]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import timeit
from typing import Any

import msgspec

from dplb.router.limits import TenantLimits
from dplb.router.peek import Peek
from dplb.router.usage import output_limit
from dplb.tenants import Tenant


class PeekBefore(msgspec.Struct):
    """:class:`Peek` without the output-limit fields (the reference)."""

    stream: Any = False
    model: Any = None
    messages: msgspec.Raw = msgspec.Raw(b"")
    prompt: msgspec.Raw = msgspec.Raw(b"")
    input: msgspec.Raw = msgspec.Raw(b"")
    previous_response_id: Any = None
    request_id: Any = None


def _body(size: int) -> bytes:
    text = ("the quick brown fox jumps over the lazy dog " * (size // 44 + 1))[:size]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 200,
                       "stream": True}).encode()


def run(repeat: int, number: int) -> dict[str, float]:
    """Median ns per request for each case (module docstring)."""
    lim = TenantLimits(Tenant("t", tokens_per_min=1e15))
    new, old = msgspec.json.Decoder(Peek).decode, msgspec.json.Decoder(PeekBefore).decode
    out = {}
    for size in (200, 4096, 65536):
        body = _body(size)
        env = {"lim": lim, "body": body, "est": len(body) // 4, "p": new(body), "output_limit": output_limit,
               "new": new, "old": old}
        cases = {
            "peek": "new(body)",
            "peek (before)": "old(body)",
            "quota": "q = lim.estimate(est, output_limit(p.max_completion_tokens, p.max_tokens, "
                     "p.max_output_tokens)); lim.check(q); lim.correct(est + 180 - q)",
            "quota (before)": "lim.check(est); lim.correct(180)",
        }
        for name, stmt in cases.items():
            times = timeit.repeat(stmt, globals=env, repeat=repeat, number=number)
            out[f"{name} {len(body)} B"] = statistics.median(times) / number * 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--number", type=int, default=20000)
    args = ap.parse_args()
    for name, ns in run(args.repeat, args.number).items():
        print(f"{name:36s} {ns:9.0f} ns/request")


if __name__ == "__main__":
    main()
