"""Per-tenant rate limits: token buckets on requests and tokens, and OpenAI's ``x-ratelimit-*`` headers
(docs/DESIGN.md §15).

Contract (pure logic; the clock is injected)
- :class:`TokenBucket`: ``rate`` units per second refill a bucket of ``capacity`` units (it starts full); a take
  may drive the level below zero (a debt: tokens counted after the response), and nothing is admitted until it is
  paid back.
- :class:`TenantLimits` holds one tenant's buckets: ``requests_per_s`` (capacity one second's worth, at least 1)
  and ``tokens_per_min`` (capacity one minute's worth).
- Tokens are reserved at admission and corrected at the end, as OpenAI counts its own limits ("your rate limit is
  calculated as the maximum of max_tokens and the estimated number of tokens based on the character count of your
  request", platform.openai.com/docs/guides/rate-limits; the request's cost is taken up front) and as reserving
  limiters do (token-throttle: reserve before the call, refund what was not used). Counting only after the
  response (Envoy AI Gateway's usage-based limits check the running total before a request and add its usage
  after it) lets a burst of concurrent requests all pass a bucket that is still full. :meth:`TenantLimits.estimate`
  is the reservation: the prompt estimate plus the request's output limit (``max_tokens`` and its aliases) times
  the sequences it generates (``n``, vLLM's ``best_of``: each may run to the limit), or
  :data:`DEFAULT_OUTPUT_TOKENS` per sequence capped at what the bucket's capacity leaves after the prompt when the
  body sets none. :meth:`TenantLimits.check` refuses a reservation larger than the whole bucket (400
  ``tokens_exceed_quota``: no wait makes it fit), else refuses with the error kind and the exact ``Retry-After``
  (whole seconds, rounded up: when the bucket holds enough again), or admits it and takes one request and the
  reservation (the bucket never goes below zero at admission); :meth:`TenantLimits.correct` adds the difference
  between the engine's count and the reservation when the request ends (a debt only when the engine counted more
  than was reserved: a prompt larger than its estimate). A refusal's message gives both times, read at one
  instant with the headers of :meth:`TenantLimits.headers` ``(refill=False)``: when the request would be admitted
  (``Retry-After`` is that, rounded up to whole seconds) and when the bucket is full again (the
  ``x-ratelimit-reset-*`` header, OpenAI's meaning: back to its initial state), in the headers' format.
- :meth:`TenantLimits.debit`: what the other processes of a router group admitted meanwhile, taken without a check
  (:mod:`dplb.router.group_quota`); a give-back never fills a bucket past its capacity.
- :meth:`TenantLimits.headers`: ``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``,
  ``x-ratelimit-reset-requests`` (time until the bucket is full, OpenAI's ``1s`` / ``6m0s`` / ``20ms`` form) and
  the same three for ``tokens`` — only for the limits the tenant has; remaining is within ``[0, limit]`` (a debt
  reads 0; a refund never fills a bucket past its capacity). :func:`concurrency_headers`: the three for
  ``concurrent`` (``max_concurrent``) on its 429: the limit, 0 remaining, and the ``Retry-After`` hint as the reset
  (a slot frees when one of the tenant's requests ends: no exact time).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from dplb.errors import RouterErrorKind
from dplb.tenants import Tenant

#: Output tokens reserved for a request whose body sets no ``max_tokens`` / ``max_completion_tokens`` /
#: ``max_output_tokens`` (the engine's own cap is then the context left, unknown to the router); capped per tenant
#: at its bucket's capacity less the prompt, so such a request is never refused as too large for the quota.
DEFAULT_OUTPUT_TOKENS = 1024


class TokenBucket:
    """``rate`` units/s into a bucket of ``capacity`` units (module docstring). ``clock``: seconds."""

    __slots__ = ("capacity", "clock", "level", "rate", "t")

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.capacity = capacity
        self.clock = clock
        self.level = capacity
        self.t = clock()

    def refill(self) -> float:
        """The level now (refilled since the last look)."""
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
        self.t = now
        return self.level

    def wait_s(self, amount: float, refill: bool = True) -> float:
        """Seconds until the bucket holds ``amount`` (capped at its capacity); 0 when it does now. ``refill``:
        False to read the level of the last :meth:`refill` (the same instant as another reading)."""
        need = min(amount, self.capacity) - (self.refill() if refill else self.level)
        return need / self.rate if need > 0 else 0.0

    def take(self, amount: float) -> None:
        """Take ``amount`` (may go negative: a debt); :meth:`refill` first. A negative ``amount`` (a refund, or a
        router group's give-back) fills the bucket at most to its capacity: what refilled meanwhile already counts."""
        self.refill()
        self.level -= amount
        if amount < 0 and self.level > self.capacity:
            self.level = self.capacity

    def reset_s(self, refill: bool = True) -> float:
        """Seconds until the bucket is full again (``refill``: as in :meth:`wait_s`)."""
        return max(0.0, self.capacity - (self.refill() if refill else self.level)) / self.rate


def reset_text(seconds: float) -> str:
    """OpenAI's reset duration: ``"20ms"`` below 1 s, ``"1.5s"``, ``"6m0s"``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    m, s = divmod(math.ceil(seconds), 60)
    return f"{m}m{s}s"


class TenantLimits:
    """One tenant's request and token buckets (None where the tenant sets no limit)."""

    def __init__(self, tenant: Tenant, clock: Callable[[], float] = time.monotonic) -> None:
        r, t = tenant.requests_per_s, tenant.tokens_per_min
        self.requests = TokenBucket(r, max(1.0, r), clock) if r else None
        self.tokens = TokenBucket(t / 60.0, t, clock) if t else None

    @property
    def any(self) -> bool:
        """True when the tenant has a request or token limit."""
        return self.requests is not None or self.tokens is not None

    def estimate(self, prompt: int, output: int, seqs: int = 1) -> int:
        """Tokens to reserve for a request of ``prompt`` estimated prompt tokens that generates ``seqs`` sequences
        (``n`` / ``best_of``: :func:`dplb.router.usage.sequences`) of at most ``output`` tokens each: the prompt
        plus ``output × seqs``. ``output`` 0 (the body sets none): :data:`DEFAULT_OUTPUT_TOKENS` per sequence,
        capped at what the capacity leaves after the prompt. 0 without a token limit."""
        if self.tokens is None:
            return 0
        if output <= 0:
            return prompt + max(1, min(DEFAULT_OUTPUT_TOKENS * seqs, math.floor(self.tokens.capacity) - prompt))
        return prompt + output * seqs

    def check(self, tokens: int, scale: int = 1) -> tuple[RouterErrorKind, int, str] | None:
        """Refuse (kind, Retry-After seconds, message) or admit a request reserving ``tokens``
        (:meth:`estimate`; then one request and ``tokens`` are taken, each times ``scale``: a router group's
        fallback, :mod:`dplb.router.group_quota`). A reservation over the token bucket's capacity is refused with
        :attr:`RouterErrorKind.TOKENS_EXCEED_QUOTA` (its Retry-After is 0: unused)."""
        for b in (self.requests, self.tokens):  # one instant for the checks, the message and the headers
            if b is not None:
                b.refill()
        if self.tokens is not None and tokens > self.tokens.capacity:
            return (RouterErrorKind.TOKENS_EXCEED_QUOTA, 0, f"this request needs about {tokens} tokens (the prompt "
                    "estimate plus max_tokens times the sequences generated, n or best_of), more than the whole "
                    f"quota of {self.tokens.capacity:g} tokens/min: lower max_tokens or n, or shorten the prompt")
        if self.requests is not None:
            w = self.requests.wait_s(scale, refill=False)
            if w > 0:
                return (RouterErrorKind.RATE_LIMITED, math.ceil(w), f"rate limit of {self.requests.rate:g} "
                        f"requests/s reached; retry in {reset_text(w)} (one request is back then; all "
                        f"{math.floor(self.requests.capacity)} in {reset_text(self.requests.reset_s(False))}, "
                        "x-ratelimit-reset-requests)")
        if self.tokens is not None:
            w = self.tokens.wait_s(max(tokens * scale, 1), refill=False)
            if w > 0:
                return (RouterErrorKind.TOKENS_RATE_LIMITED, math.ceil(w), f"rate limit of "
                        f"{self.tokens.capacity:g} tokens/min reached; retry in {reset_text(w)} (this request's "
                        f"{max(tokens, 1)} tokens are back then; all in {reset_text(self.tokens.reset_s(False))}, "
                        "x-ratelimit-reset-tokens)")
        if self.requests is not None:
            self.requests.take(scale)
        if self.tokens is not None:
            self.tokens.take(tokens * scale)
        return None

    def debit(self, requests: int, tokens: int) -> None:
        """Take what other router processes of the group admitted meanwhile: ``requests`` requests and ``tokens``
        tokens (negative: they gave back), without a check (:mod:`dplb.router.group_quota`)."""
        if self.requests is not None and requests:
            self.requests.take(requests)
        if self.tokens is not None and tokens:
            self.tokens.take(tokens)

    def correct(self, tokens: int) -> None:
        """Take ``tokens`` more (negative: give back) once the engine's count is known."""
        if self.tokens is not None and tokens:
            self.tokens.take(tokens)

    def headers(self, refill: bool = True) -> list[tuple[bytes, bytes]]:
        """The ``x-ratelimit-*`` response headers (module docstring); ``refill=False``: at the instant of the last
        :meth:`check` (a refusal's headers, which its message quotes)."""
        out: list[tuple[bytes, bytes]] = []
        for name, b in ((b"requests", self.requests), (b"tokens", self.tokens)):
            if b is None:
                continue
            level = b.refill() if refill else b.level
            out += [(b"x-ratelimit-limit-" + name, b"%d" % math.floor(b.capacity)),
                    (b"x-ratelimit-remaining-" + name, b"%d" % max(0, min(math.floor(b.capacity),
                                                                          math.floor(level)))),
                    (b"x-ratelimit-reset-" + name, reset_text(b.reset_s(False)).encode())]
        return out


def concurrency_headers(limit: int, retry_after_s: float) -> list[tuple[bytes, bytes]]:
    """The ``x-ratelimit-*-concurrent`` headers of a ``max_concurrent`` 429 (module docstring)."""
    return [(b"x-ratelimit-limit-concurrent", b"%d" % limit), (b"x-ratelimit-remaining-concurrent", b"0"),
            (b"x-ratelimit-reset-concurrent", reset_text(retry_after_s).encode())]


__all__ = ["DEFAULT_OUTPUT_TOKENS", "TenantLimits", "TokenBucket", "concurrency_headers", "reset_text"]
