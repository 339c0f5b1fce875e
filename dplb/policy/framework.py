"""The policy framework: one small interface per extension point, and a registry for each (docs/DESIGN.md §5).

Modelled on the Gateway API Inference Extension's scheduler (``pkg/epp/scheduling/framework/plugins.go``,
``plugins/registry.go``): a pick runs **filters** (eligibility), then weighted **scorers** (each 0–1 per candidate),
then one **picker**. Plugins work on the whole candidate list at once (one call per plugin per pick, not per
worker), which keeps ``pick()`` for 8 workers near 15 µs in CPython.

Contract of each extension point
- :class:`Plugin` (scorers and pickers): a registered ``name``, its own ``parameters`` (:class:`Param`: type,
  default and accepted values, declared once; ``--scorer-param NAME.PARAM=VALUE`` sets one, resolved into
  ``self.params`` when the plugin is built), and optional hooks: ``prepare(request)`` once per request that
  carries a prompt, before its first pick (derive what the plugin needs from ``request.prompt`` and keep it in
  ``request.derived[name]``); ``stats()`` for metrics (read by name in :mod:`dplb.obs.metrics_scrape`).
- What a plugin's code returns is checked at the boundary (built-ins are called as they are): ``score`` and
  ``pick`` results are normalised or fail the pick (:func:`plugin_scores`, :func:`plugin_pick`); the
  observational hooks ``inputs``, ``notes``, ``stats`` are normalised or left out of the view (:class:`PluginView`,
  :func:`plugin_stats`), one :class:`PluginError` logged per plugin and hook.
- :class:`Filter`: ``apply(cands, ctx)`` sets ``c.why`` to one of its ``reasons`` on every still-eligible
  candidate it rejects; never un-rejects. ``health = True`` for filters about the worker itself (registered, fresh,
  ready, …): those decide ``/ready``, ``dplb_worker_up`` and ``dplb state``; the others (retry exclusion, hard cap)
  are about one request.
- :class:`Scorer`: ``score(cands, ctx)`` returns one float per candidate (same order; higher is better). The
  framework clamps every value of a scorer not marked ``bounded`` into [0, 1] (NaN → 0), so a plugin returning 5.0
  cannot win every pick; built-ins that guarantee [0, 1] themselves (tests/test_scorers.py) are marked ``bounded``
  and skip the clamp. A candidate's score is Σ weight·term in scorer order (:func:`set_scores`). Every candidate
  is scored, eligible or not (visibility); scorers that compare workers (latency deadband, prefix match) look
  only at the eligible ones. ``inputs(c, ctx)`` names what the scorer read,
  for ``/debug/decisions`` and traces (not called on the hot path). Optional hooks: ``on_pick(request, worker,
  now_ns)`` after a worker is chosen for real (it may set ``request.learned`` for the other router processes),
  ``notes(request, worker)``: what it observed about a routed request, by note name, for the metrics and views
  (asked only when someone looks, :attr:`dplb.policy.decision.Decision.notes`: it costs the pick nothing),
  ``forget_worker(worker)`` when a worker restarted, ``absorb(entries, now_ns)`` to apply what the other router
  processes learnt (the raw entries of their rings, :mod:`dplb.state.router_slots`; at most one configured scorer
  may implement it: the rings carry one kind of key), ``absorb_engine(entries, events_mask, now_ns)`` to apply
  what the workers' engines confirmed and evicted (their KV rings, :mod:`dplb.state.kv_rings`).
- :class:`Picker`: ``pick(eligible, ctx)`` chooses among the eligible candidates (given in rotated order, so
  "first" rotates) and returns ``(candidate, reason)``.

Adding a scorer: a class with ``name`` and ``score`` in one file, plus one line ``register_scorer(MyScorer)``; then
``--weights queue=0.3,…,my=0.1`` uses it, and metrics, traces and ``/debug/decisions`` show its term by name
(tests/test_policy_framework.py registers a toy scorer).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence, Set, Sized
from dataclasses import dataclass
from typing import Any, ClassVar

from dplb.config import PolicyConfig
from dplb.errors import ConfigError, PluginError
from dplb.native import mypyc_attr
from dplb.policy.decision import Candidate
from dplb.state.shm import WorkerState


class RouteRequest:
    """What the policy knows about one request (one object instead of a parameter list, like uvicorn's
    ``RequestResponseCycle``). The router fills the first three; plugins fill the rest.

    ``prompt``: the prompt's raw bytes as the client sent them (``bytes``, ``memoryview`` or ``msgspec.Raw``; None
    = no prompt): the raw JSON of ``messages`` for chat, of ``prompt`` for completions, of ``input`` otherwise.
    ``cannot_serve``: worker ids that cannot serve it (they do not serve its model, or it names a response another
    worker holds: :mod:`dplb.router.models`); ``exclude``: worker ids already tried (a failed connect).
    Filled by plugins: ``derived`` (plugin name → what its ``prepare`` hook derived from the prompt; a plugin reads
    only its own), ``preferred`` (the worker an affinity plugin prefers: the longest prefix match, the rendezvous
    worker), ``learned`` (after the pick: keys the other router processes must learn, < 2**42 each, published for
    the chosen worker).
    """

    __slots__ = ("cannot_serve", "derived", "exclude", "learned", "preferred", "prepared", "prompt")

    def __init__(self, prompt: Any = None, exclude: frozenset[int] = frozenset(),
                 cannot_serve: frozenset[int] = frozenset()) -> None:
        self.prompt = prompt
        self.exclude = exclude
        self.cannot_serve = cannot_serve
        self.prepared = False
        self.derived: dict[str, Any] = {}
        self.preferred: int | None = None
        self.learned: list[int] | None = None


class PickContext:
    """The inputs one pick shares across plugins: ``now_ns`` (CLOCK_MONOTONIC), the request, the frozen latency
    baseline (seconds, None until frozen), and the router's own health verdicts: ``held`` (heartbeat hysteresis)
    and ``ejected`` (refused connections, passive health check) and ``stalled`` (no engine progress,
    :mod:`dplb.policy.stall`) worker ids."""

    __slots__ = ("baseline_s", "ejected", "held", "now_ns", "request", "stalled")

    def __init__(self, now_ns: int, request: RouteRequest, baseline_s: float | None,
                 held: frozenset[int] = frozenset(), ejected: frozenset[int] = frozenset(),
                 stalled: frozenset[int] = frozenset()) -> None:
        self.now_ns = now_ns
        self.request = request
        self.baseline_s = baseline_s
        self.held = held
        self.ejected = ejected
        self.stalled = stalled


_KINDS: dict[type, str] = {int: "an integer", float: "a finite number", str: "a word", bool: "true or false"}


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter a plugin declares: ``name`` (an identifier), ``kind`` (``int``, ``float``, ``str`` or
    ``bool``), ``default``, and what values it accepts: ``choices`` (for words) or ``check`` (a predicate) with
    ``expect`` describing them ("1..65536 bytes"). ``field``: the :class:`PolicyConfig` field of an older flag that
    sets it (``--prefix-block-bytes``); its value, validated by :class:`PolicyConfig`, is then the default and
    ``default`` is unused (the default is written once, there). ``help``: one line for ``--help`` and errors."""

    name: str
    kind: type
    default: Any = None
    field: str | None = None
    choices: tuple[str, ...] = ()
    check: Callable[[Any], bool] | None = None
    expect: str = ""
    help: str = ""

    def accepted(self) -> str:
        """``"an integer, 1..65536 bytes"``: what values it accepts."""
        what = "one of " + ", ".join(self.choices) if self.choices else _KINDS[self.kind]
        return f"{what}, {self.expect}" if self.expect else what

    def describe(self) -> str:
        """``"block_bytes (an integer, 1..65536 bytes)"``: the parameter with its accepted values."""
        return f"{self.name} ({self.accepted()})"

    def parse(self, text: str) -> Any:
        """The value of ``text`` for this parameter. Raises ValueError (message: what is accepted)."""
        try:
            if self.kind is bool:
                if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                value: Any = text.lower() in ("true", "1", "yes")
            elif self.kind is float:
                value = float(text)
                if not math.isfinite(value):
                    raise ValueError
            else:
                value = self.kind(text)
        except ValueError:
            raise ValueError(f"must be {self.accepted()}") from None
        if (self.choices and value not in self.choices) or (self.check is not None and not self.check(value)):
            raise ValueError(f"must be {self.accepted()}")
        return value


def resolve_params(cls: type[Plugin], cfg: PolicyConfig) -> dict[str, Any]:
    """Plugin class ``cls``'s parameters for ``cfg``: each declared :class:`Param` from ``cfg.params`` when given
    there, else its ``field`` of ``cfg``, else its default. Raises :class:`ConfigError` (one line naming the flag)
    for a parameter ``cls`` does not declare or a value it does not accept."""
    declared = {p.name: p for p in cls.parameters}
    out = {p.name: getattr(cfg, p.field) if p.field else p.default for p in cls.parameters}
    for plugin, name, text in cfg.params:
        if plugin != cls.name:
            continue
        flag = f"--scorer-param {plugin}.{name}={text}"
        p = declared.get(name)
        if p is None:
            have = "; ".join(q.describe() for q in cls.parameters) or "none"
            raise ConfigError(f"{flag}: {plugin} has no parameter {name!r}; its parameters: {have}")
        try:
            out[name] = p.parse(text)
        except ValueError as e:
            raise ConfigError(f"{flag}: {plugin}.{name} {e}") from None
    return out


# Subclassed by code mypyc does not compile (plugins, tests): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class Plugin:
    """What scorers and pickers share: ``name``, declared ``parameters`` and their resolved values ``params``
    (name → value), and the optional ``prepare`` and ``stats`` hooks (see the module docstring)."""

    name: ClassVar[str] = ""
    parameters: ClassVar[tuple[Param, ...]] = ()

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        self.cfg = cfg
        self.num_workers = num_workers
        self.params = resolve_params(type(self), cfg)

    def prepare(self, request: RouteRequest) -> None:
        """Derive what this plugin needs from ``request.prompt`` (not None) into ``request.derived[self.name]``;
        called once per request, before its first pick."""

    def stats(self) -> dict[str, float]:
        """Numbers about this plugin's own state for metrics (stat name → value; e.g. the prefix index's size)."""
        return {}


# Subclassed by code mypyc does not compile (plugins, tests): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class Filter:
    """Eligibility rule. ``reasons``: the ``why`` values it sets (the first is the usual one)."""

    reasons: ClassVar[tuple[str, ...]] = ()
    health: ClassVar[bool] = True

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg

    def apply(self, cands: list[Candidate], ctx: PickContext) -> None:
        raise NotImplementedError


# Subclassed by code mypyc does not compile (plugins, tests): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class Scorer(Plugin):
    """One score term per candidate, higher is better; clamped into [0, 1] unless ``bounded``."""

    #: True when ``score`` itself guarantees every value is in [0, 1] (the framework then skips the clamp).
    bounded: ClassVar[bool] = False

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        raise NotImplementedError

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        """What this scorer read for candidate ``c`` (for views; default: nothing beyond the term)."""
        return {}

    def on_pick(self, request: RouteRequest, worker: int, now_ns: int) -> None:
        """``worker`` was chosen for ``request`` (not called for dry runs)."""

    def forget_worker(self, worker: int) -> None:
        """``worker`` restarted (new pid): drop what was learnt about it."""

    def notes(self, request: RouteRequest, worker: int) -> dict[str, Any] | None:
        """What this scorer observed about ``request``, routed to ``worker`` (note name → value; names in
        :mod:`dplb.policy.decision`), or None. Asked after the pick, only when someone looks."""
        return None

    def absorb(self, entries: Mapping[int, Sequence[int]], now_ns: int) -> None:
        """Apply what the other router processes learnt: ``entries`` = worker id → keys they published for it
        (``request.learned`` of their picks), in ring order."""

    def absorb_engine(self, entries: Mapping[int, Sequence[int]] | None, events_mask: int, now_ns: int) -> None:
        """Apply what the workers said their engines hold: ``entries`` = worker id → raw KV-ring entries
        (``op << 56 | key``, :mod:`dplb.state.kv_rings`; None: nothing new), ``events_mask``: bit w set when
        worker w publishes them. Called before every pick when the segment has KV rings."""


def clamp_unit(column: list[float]) -> list[float]:
    """``column`` with every value clamped into [0, 1]; NaN → 0."""
    return [v if 0.0 <= v <= 1.0 else (1.0 if v > 1.0 else 0.0) for v in column]


def set_scores(cands: list[Candidate], columns: list[list[float]], weights: tuple[float, ...]) -> None:
    """Set every candidate's ``score`` = Σ_j weights[j]·columns[j][k] (``columns[j][k]``: scorer j's term for
    ``cands[k]``, summed in scorer order). Written out for three and four scorers (the defaults): one loop instead
    of one per scorer. Raises ValueError when a column's length is not the candidates'."""
    n = len(cands)
    for col in columns:
        if len(col) != n:
            raise ValueError(f"a scorer returned {len(col)} terms for {n} candidates")
    if len(columns) == 4:
        (a, b, c, d), (wa, wb, wc, wd) = columns, weights
        for cand, p, q, r, s in zip(cands, a, b, c, d, strict=False):  # lengths checked above
            cand.score = wa * p + wb * q + wc * r + wd * s
        return
    if len(columns) == 3:
        (a, b, c), (wa, wb, wc) = columns, weights
        for cand, p, q, r in zip(cands, a, b, c, strict=False):
            cand.score = wa * p + wb * q + wc * r
        return
    out = [0.0] * len(cands)
    for col, w in zip(columns, weights, strict=True):
        out = [x + w * v for x, v in zip(out, col, strict=True)]
    for cand, sc in zip(cands, out, strict=True):
        cand.score = sc


def plugin_scores(scorer: Scorer, cands: list[Candidate], ctx: PickContext) -> list[float]:
    """``scorer.score(cands, ctx)`` for a scorer whose code the framework does not own (a plugin's, or a plugin's
    subclass of a built-in): any sequence of one real number per candidate (list, tuple, array; ints, bools, numpy
    numbers) becomes the framework's list of floats; the clamp of unbounded scorers applies after, as for every
    scorer. Anything else (not a sized iterable, a str or mapping or set, another length, a value that is not a
    real number) raises :class:`PluginError` saying what it returned, logged once per scorer at ERROR: the pick
    fails as it does when the scorer raises. The same in pure Python and compiled (where a typed call would check
    for a ``list`` itself and fail with a bare ``TypeError``)."""
    score: Callable[[list[Candidate], PickContext], object] = scorer.score
    raw = score(cands, ctx)
    n = len(cands)
    if type(raw) is list and len(raw) == n and all(type(v) is float for v in raw):
        return raw
    if isinstance(raw, str | bytes | bytearray | Mapping | Set) or not isinstance(raw, Sized) \
            or not isinstance(raw, Iterable):
        problem = f"a {type(raw).__name__}, not a sequence of numbers"
    elif len(raw) != n:
        problem = f"{len(raw)} values for {n} candidates"
    else:
        out: list[float] = []
        for v in raw:
            if not isinstance(v, numbers.Real):
                problem = f"{v!r} (a {type(v).__name__}) at index {len(out)}"
                break
            out.append(float(v))
        else:
            return out
    raise _plugin_error(scorer, f"score() returned {problem}; it must return one number per candidate, in order")


def plugin_pick(picker: Picker, eligible: list[Candidate], ctx: PickContext) -> tuple[Candidate, str]:
    """``picker.pick(eligible, ctx)`` for a picker whose code the framework does not own: any pair (tuple, list) of
    a :class:`Candidate` and a ``str`` reason. Anything else raises :class:`PluginError`, logged once per picker
    (see :func:`plugin_scores`)."""
    pick: Callable[[list[Candidate], PickContext], object] = picker.pick
    raw = pick(eligible, ctx)
    if isinstance(raw, tuple | list) and len(raw) == 2 and isinstance(raw[0], Candidate) \
            and isinstance(raw[1], str):
        return raw[0], raw[1]
    raise _plugin_error(picker, f"pick() returned {raw!r}; it must return (candidate, reason: str)")


_log = logging.getLogger("dplb.policy")
#: The plugins whose broken result was logged (by name: one line each per process).
_REPORTED: set[str] = set()


def _plugin_error(plugin: Plugin, problem: str, hook: str = "",
                  then: str = "every pick fails until it is fixed") -> PluginError:
    """The :class:`PluginError` for ``plugin``'s ``problem`` (``then``: what follows from it); logged the first time
    for that plugin and ``hook`` ("": the pick's own ``score``/``pick``)."""
    cls = type(plugin)
    where = f"{getattr(cls, '__module__', '?')}.{cls.__qualname__}"
    err = PluginError(f"policy plugin {plugin.name!r} ({where}): {problem}; {then}")
    key = f"{plugin.name}.{hook}" if hook else plugin.name
    if key not in _REPORTED:
        _REPORTED.add(key)
        _log.error("%s", err)
    return err


def _view(plugin: Plugin, hook: str, call: Callable[[], object], numbers_only: bool = False) -> dict[str, Any] | None:
    """What a plugin's observational ``hook`` (``inputs``, ``notes``, ``stats``) returned through ``call``, as the
    framework's ``dict`` with ``str`` keys (None for None; ``numbers_only``: every value a real number, as float).
    These hooks feed views, traces and metrics, never the choice: a hook that raises or returns anything else
    (not a mapping, a key not a str, a value not a number where one is needed) gives None, with one
    :class:`PluginError` logged per plugin and hook, so a broken plugin leaves its part of a view out instead of
    failing the request or the ``/metrics`` scrape."""
    try:
        raw = call()
    except Exception as e:  # a plugin's own bug: its part of the view is left out
        _plugin_error(plugin, f"{hook}() raised {type(e).__name__}: {e}", hook, f"its {hook} are left out")
        return None
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        problem = f"a {type(raw).__name__}"
    elif not all(type(k) is str for k in raw):
        problem = "a mapping with a key that is not a str"
    elif not numbers_only:
        return dict(raw)
    elif all(isinstance(v, numbers.Real) for v in raw.values()):
        return {k: float(v) for k, v in raw.items()}
    else:
        problem = "a mapping with a value that is not a real number"
    _plugin_error(plugin, f"{hook}() returned {problem}; it must return a dict of name → "
                  f"{'number' if numbers_only else 'value'} or None", hook, f"its {hook} are left out")
    return None


class PluginView:
    """A plugin scorer's ``inputs`` and ``notes`` hooks as the views call them, normalised (:func:`_view`); the
    policy hands the views these instead of the plugin scorers themselves (built-ins are called as they are)."""

    __slots__ = ("name", "scorer")

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer
        self.name = scorer.name

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        """``scorer.inputs(c, ctx)`` normalised; ``{}`` when broken."""
        return _view(self.scorer, "inputs", lambda: self.scorer.inputs(c, ctx)) or {}

    def notes(self, request: RouteRequest, worker: int) -> dict[str, Any] | None:
        """``scorer.notes(request, worker)`` normalised; None when broken."""
        return _view(self.scorer, "notes", lambda: self.scorer.notes(request, worker))


def plugin_stats(plugin: Plugin) -> dict[str, float]:
    """``plugin.stats()`` for a plugin whose code the framework does not own: a dict of name → float; ``{}`` when
    broken (:func:`_view`: the scrape goes on without it)."""
    return _view(plugin, "stats", plugin.stats, numbers_only=True) or {}


# Subclassed by code mypyc does not compile (plugins, tests): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class Picker(Plugin):
    """Chooses among eligible candidates (rotated order)."""

    def pick(self, eligible: list[Candidate], ctx: PickContext) -> tuple[Candidate, str]:
        raise NotImplementedError


# ---- registries ---------------------------------------------------------------------------------------------------
SCORERS: dict[str, type[Scorer]] = {}
PICKERS: dict[str, type[Picker]] = {}


def register_scorer(cls: type[Scorer]) -> type[Scorer]:
    """Make ``cls`` available to ``--weights NAME=W`` under ``cls.name`` (usable as a decorator).
    Raises ValueError for an empty or already taken name."""
    _register(SCORERS, cls, "scorer")
    return cls


def register_picker(cls: type[Picker]) -> type[Picker]:
    """Make ``cls`` available to policy profiles under ``cls.name``. Raises ValueError for a taken name."""
    _register(PICKERS, cls, "picker")
    return cls


def _register(table: dict[str, Any], cls: Any, kind: str) -> None:
    if not cls.name or not cls.name.isidentifier():
        raise ValueError(f"a {kind} needs a name that is an identifier, got {cls.name!r}")
    taken = plugin_class(cls.name)
    if taken is not None and taken is not cls:
        raise ValueError(f"{kind} name {cls.name!r} is already registered by {taken.__qualname__}")
    table[cls.name] = cls


def plugin_class(name: str) -> type[Plugin] | None:
    """The scorer or picker class registered as ``name`` (one namespace for both: ``--scorer-param`` names
    either), or None."""
    return SCORERS.get(name) or PICKERS.get(name)


def build_scorers(cfg: PolicyConfig, num_workers: int) -> list[tuple[Scorer, float]]:
    """The configured scorers with their weights, in ``cfg.weights`` order. Raises :class:`ConfigError` for a
    scorer name nobody registered."""
    out = []
    for name, w in cfg.effective_weights():
        cls = SCORERS.get(name)
        if cls is None:
            raise ConfigError(f"--weights names an unknown scorer {name!r}; known: {', '.join(sorted(SCORERS))}")
        out.append((cls(cfg, num_workers), w))
    return out


def max_queue_of(w: WorkerState, cfg: PolicyConfig) -> int:
    """Soft queue cap for worker ``w``: its published ``max_num_seqs`` with ``max_queue_from_worker``, else
    ``cfg.max_queue`` (requests)."""
    return w.max_num_seqs if cfg.max_queue_from_worker and w.max_num_seqs > 0 else cfg.max_queue

