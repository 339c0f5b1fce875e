"""Seeded benchmark workloads: what each request asks for and when it is sent.

Contract
- :func:`build_workload` turns a :class:`WorkloadSpec` into a list of :class:`BenchRequest` (prompt, output length,
  send offset in seconds from the start), sorted by offset. The same spec (including ``seed``) always gives the
  same list, so every policy in a comparison sees exactly the same requests at the same times.
- Prompts are words from a fixed vocabulary; one word ≈ one token for the sim engine (it tokenises on whitespace),
  roughly 1–2 tokens for a real tokenizer. Lengths are in those words/tokens.
- Arrivals: Poisson at ``request_rate`` requests/s (exponential gaps, as vLLM's benchmark_serving), all at t=0 for
  ``inf``, or bursts of ``burst_size`` requests arriving together every ``burst_interval_s``, after ``idle_s``.
- Multi-turn (``conversations`` > 0): ``conversations`` chats of ``turns`` turns each, all opening with one shared
  system prompt of ``prefix_len`` words; turn t's messages are the whole history (system, then every earlier user
  turn and a synthetic assistant reply of ``output_len`` words) plus a new user turn of ``input_len`` words.
  Conversations start by Poisson arrivals at ``request_rate / turns`` (so the request rate is ``request_rate``);
  each later turn is sent when the previous one has completed plus a think time (exponential, mean ``think_s``):
  ``BenchRequest.after`` names the request it waits for. Requests are ordered by (conversation, turn).
- Datasets: ``synthetic`` (lengths drawn uniformly within ``[len·(1−range_ratio), len·(1+range_ratio)]``; a
  ``long_fraction`` of requests use the long lengths; a ``shared_prefix_fraction`` of requests start with one of
  ``num_prefixes`` system prompts of ``prefix_len`` words), or a JSONL file of ShareGPT-style conversations
  (``{"conversations": [{"from": "human", "value": …}, {"from": "gpt", "value": …}]}``), ``{"messages": [...]}``
  or ``{"prompt": "…", "max_tokens": N}`` lines; the output length is the reply's word count unless
  ``output_len`` is forced. Raises :class:`~dplb.errors.ConfigError` for bad specs or unreadable datasets.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace

from dplb.errors import ConfigError

_VOCAB = (
    "able", "acid", "aged", "also", "area", "army", "away", "baby", "back", "ball", "band", "bank", "base", "bath",
    "bear", "beat", "been", "beer", "bell", "belt", "best", "bill", "bird", "blow", "blue", "boat", "body", "bomb",
    "bond", "bone", "book", "boom", "born", "boss", "both", "bowl", "bulk", "burn", "bush", "busy", "call", "calm",
    "came", "camp", "card", "care", "case", "cash", "cast", "cell", "chat", "chip", "city", "club", "coal", "coat",
    "code", "cold", "come", "cook", "cool", "cope", "copy", "core", "cost", "crew", "crop", "dark", "data", "date",
    "dawn", "days", "dead", "deal", "dean", "dear", "debt", "deep", "deny", "desk", "dial", "diet", "disc", "disk",
)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to send. Lengths in words (≈ tokens), times in seconds, fractions in [0, 1]."""

    num_prompts: int = 200
    request_rate: float = math.inf  # requests/s (Poisson); inf = all at once
    burst_size: int = 0  # > 0: bursts of this many requests together instead of Poisson arrivals
    burst_interval_s: float = 2.0
    idle_s: float = 0.0  # quiet time before the first request
    input_len: int = 128
    output_len: int = 32
    range_ratio: float = 0.0
    long_fraction: float = 0.0
    long_input_len: int = 1024
    long_output_len: int = 256
    shared_prefix_fraction: float = 0.0
    num_prefixes: int = 4
    prefix_len: int = 512
    dataset: str = "synthetic"  # or a path to a .jsonl file
    conversations: int = 0  # > 0: multi-turn chats (see the module docstring); num_prompts = conversations · turns
    turns: int = 5
    think_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ConfigError(f"--num-prompts must be ≥ 1, got {self.num_prompts}")
        if not (self.request_rate > 0):
            raise ConfigError(f"--request-rate must be > 0 requests/s (or inf), got {self.request_rate}")
        for name in ("input_len", "output_len", "long_input_len", "long_output_len", "num_prefixes", "prefix_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be ≥ 1, got {getattr(self, name)}")
        for name in ("range_ratio", "long_fraction", "shared_prefix_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0 or (name == "range_ratio" and v >= 1.0):
                raise ConfigError(f"{name.replace('_', '-')} must be a fraction in [0, 1), got {v}")
        if self.conversations < 0 or self.turns < 1 or not self.think_s >= 0:
            raise ConfigError("conversations must be ≥ 0, turns ≥ 1 and think time ≥ 0 seconds")
        if self.conversations and self.num_prompts != self.conversations * self.turns:
            raise ConfigError(f"a multi-turn workload has conversations × turns = {self.conversations * self.turns} "
                              f"requests, not {self.num_prompts}")
        if self.burst_size < 0 or self.burst_interval_s <= 0 or self.idle_s < 0:
            raise ConfigError("burst size must be ≥ 0, burst interval > 0 and idle time ≥ 0 seconds")


@dataclass(slots=True)
class BenchRequest:
    """One request: ``messages`` (chat) or the same text as ``prompt`` (completions); ``max_tokens`` output tokens;
    ``send_at_s``: seconds after the start of the run; ``prefix_id``: which shared system prompt (−1 = none);
    ``after``: index of the request that must complete first (−1 = none), then ``think_s`` seconds pass;
    ``conversation``: which chat of a multi-turn workload it is a turn of (−1 = none)."""

    index: int
    messages: list[dict[str, str]]
    max_tokens: int
    send_at_s: float
    prefix_id: int = -1
    prompt_words: int = 0
    extra: dict[str, object] = field(default_factory=dict)
    after: int = -1
    think_s: float = 0.0
    conversation: int = -1

    @property
    def prompt(self) -> str:
        """The messages' contents joined by newlines (what a completions request sends)."""
        return "\n".join(m["content"] for m in self.messages)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_VOCAB) for _ in range(n))


def _length(rng: random.Random, base: int, ratio: float) -> int:
    if ratio <= 0.0:
        return base
    return max(1, rng.randint(math.floor(base * (1 - ratio)), math.ceil(base * (1 + ratio))))


def arrival_times(spec: WorkloadSpec, n: int, rng: random.Random) -> list[float]:
    """Send offsets (seconds from start) for ``n`` requests, non-decreasing."""
    if spec.burst_size > 0:
        return [spec.idle_s + (i // spec.burst_size) * spec.burst_interval_s for i in range(n)]
    if math.isinf(spec.request_rate):
        return [spec.idle_s] * n
    t, out = spec.idle_s, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(spec.request_rate)
    return out


def _synthetic(spec: WorkloadSpec, rng: random.Random) -> list[BenchRequest]:
    prefixes = [f"You are assistant number {p}. " + _words(random.Random(spec.seed * 1000 + p), spec.prefix_len)
                for p in range(spec.num_prefixes)] if spec.shared_prefix_fraction > 0 else []
    out = []
    for i in range(spec.num_prompts):
        long = rng.random() < spec.long_fraction
        in_len = _length(rng, spec.long_input_len if long else spec.input_len, spec.range_ratio)
        out_len = _length(rng, spec.long_output_len if long else spec.output_len, spec.range_ratio)
        messages, pid = [], -1
        if prefixes and rng.random() < spec.shared_prefix_fraction:
            pid = rng.randrange(len(prefixes))
            messages.append({"role": "system", "content": prefixes[pid]})
        # A unique head makes every non-shared prompt (and every request's user turn) distinct.
        messages.append({"role": "user", "content": f"request {i} {rng.getrandbits(32):08x}: " + _words(rng, in_len)})
        out.append(BenchRequest(i, messages, out_len, 0.0, pid, in_len + (spec.prefix_len if pid >= 0 else 0)))
    return out


def _multi_turn(spec: WorkloadSpec, rng: random.Random) -> list[BenchRequest]:
    system = {"role": "system", "content": "You are the assistant of one shared app. "
              + _words(random.Random(spec.seed * 1000 + 7), spec.prefix_len)}
    starts = arrival_times(replace(spec, request_rate=spec.request_rate / spec.turns), spec.conversations,
                           random.Random(spec.seed + 1))
    out: list[BenchRequest] = []
    for c in range(spec.conversations):
        history: list[dict[str, str]] = [system]
        for t in range(spec.turns):
            in_len = _length(rng, spec.input_len, spec.range_ratio)
            out_len = _length(rng, spec.output_len, spec.range_ratio)
            history = [*history, {"role": "user", "content": f"conversation {c} turn {t}: " + _words(rng, in_len)}]
            words = sum(len(m["content"].split()) for m in history)
            i = len(out)
            out.append(BenchRequest(i, history, out_len, starts[c], 0, words, after=i - 1 if t else -1,
                                    think_s=rng.expovariate(1.0 / spec.think_s) if t and spec.think_s else 0.0,
                                    conversation=c))
            history = [*history, {"role": "assistant", "content": _words(rng, out_len)}]
    return out


def _from_jsonl(spec: WorkloadSpec, rng: random.Random, forced_output: int | None) -> list[BenchRequest]:
    try:
        with open(spec.dataset, encoding="utf-8") as f:
            lines = [(no, ln) for no, ln in enumerate(f, 1) if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the dataset {spec.dataset}: {getattr(e, 'strerror', None) or e}") from e
    rows: list[tuple[list[dict[str, str]], int]] = []
    for no, line in lines:
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{spec.dataset}:{no}: not JSON ({e.args[0] if e.args else e}); one JSON object per "
                              "line is expected (convert a ShareGPT .json array with jq -c '.[]')") from None
        try:
            rows.append(_parse_row(row))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{spec.dataset}:{no}: {_row_problem(e)}; expected {{\"conversations\": [{{\"from\": "
                              "\"human\", \"value\": ...}, ...]}, {\"messages\": [...]} or {\"prompt\": ...}") from None
    if not rows:
        raise ConfigError(f"{spec.dataset} has no rows")
    out = []
    for i in range(spec.num_prompts):
        messages, reply_words = rows[rng.randrange(len(rows))] if len(rows) < spec.num_prompts else rows[i]
        n = forced_output or reply_words or spec.output_len  # no reply or max_tokens: --output-len
        words = sum(len(m["content"].split()) for m in messages)
        out.append(BenchRequest(i, [dict(m) for m in messages], n, 0.0, -1, words))
    return out


def _row_problem(e: Exception) -> str:
    if isinstance(e, KeyError):
        return f"missing key {e.args[0]!r}"
    return str(e) or type(e).__name__


def _parse_row(row: dict) -> tuple[list[dict[str, str]], int]:
    """(messages up to the last user turn, words in the reply that followed; 0 = unknown) of one JSONL row.
    Raises ValueError/KeyError/TypeError for a row of none of the three shapes."""
    if not isinstance(row, dict):
        raise TypeError(f"a JSON {type(row).__name__}, not an object")
    if "prompt" in row:
        return [{"role": "user", "content": str(row["prompt"])}], int(row.get("max_tokens") or 0)
    if "messages" in row:
        turns = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]]
    else:
        roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
        turns = []
        for t in row["conversations"]:
            if str(t["from"]) not in roles:
                raise ValueError(f"unknown speaker {t['from']!r} (human, gpt, system)")
            turns.append({"role": roles[str(t["from"])], "content": str(t["value"])})
    users = [i for i, t in enumerate(turns) if t["role"] == "user"]
    if not users:
        raise ValueError("no user turn")
    last_user = users[-1]
    reply = turns[last_user + 1]["content"] if last_user + 1 < len(turns) else ""
    return turns[:last_user + 1], len(reply.split())


def build_workload(spec: WorkloadSpec, *, force_output_len: bool = False) -> list[BenchRequest]:
    """The requests of ``spec``, sorted by send time. ``force_output_len``: a JSONL dataset's requests ask for
    ``spec.output_len`` tokens instead of their reply's length. Raises :class:`ConfigError`."""
    rng = random.Random(spec.seed)
    if spec.conversations:
        return _multi_turn(spec, rng)
    if spec.dataset == "synthetic":
        reqs = _synthetic(spec, rng)
    else:
        reqs = _from_jsonl(spec, rng, spec.output_len if force_output_len else None)
    for r, t in zip(reqs, arrival_times(spec, len(reqs), random.Random(spec.seed + 1)), strict=True):
        r.send_at_s = t
    return reqs
