"""Lock-free histogram and counter families for the router's per-request hot path (docs/DESIGN.md §9).

prometheus_client's ``Histogram.observe`` walks the bucket bounds in a Python loop and takes a lock per value
(sum and bucket), ``Counter.inc`` takes one; at ~5 observations and ~2 increments per proxied request that is a
tenth of the router's per-request CPU. :class:`HistogramFamily` and :class:`CounterFamily` are drop-ins for the
calls the hot path makes, with the same exposition.

Contract:

- ``Family(name, documentation, labelnames, registry=..., buckets=...)`` registers the family in ``registry`` as a
  Collector, under the same name rules as prometheus_client (a counter's ``_total`` suffix is dropped from the
  family name; a histogram's bounds must be sorted, ``+Inf`` is appended, ``le`` is not a label name).
- ``labels(*values)`` (or ``labels(**by_name)``) returns the child for those values (``str()`` of each), made once
  and cached; a family without label names is its own only child (``observe``/``inc`` on the family, or
  ``labels()``). A wrong number of values raises ValueError.
- ``HistogramChild.observe(v, exemplar=None)``: one bisect over the bounds and plain float updates; ``v`` counts in
  the first bucket whose bound is ≥ ``v``; a NaN is added to ``_sum`` and to no bucket. ``exemplar`` (a label
  dict, validated as prometheus_client does) is kept on that bucket with ``v`` and ``time.time()``.
- ``CounterChild.inc(n=1, exemplar=None)``: adds ``n`` (ValueError when negative); the exemplar is kept on
  ``_total``.
- ``collect()`` yields one ``HistogramMetricFamily``/``CounterMetricFamily`` whose samples are exactly those of
  the prometheus_client metric fed the same values, children in creation order: cumulative ``_bucket``s with
  their exemplars (OpenMetrics output shows them), ``_count``, ``_sum`` (only when the first bound is ≥ 0),
  ``_created`` (``time.time()`` when the child was made; omitted while prometheus_client's created series are off,
  ``PROMETHEUS_DISABLE_CREATED_SERIES`` or ``disable_created_metrics()``, read at each collect).

Threads: no lock. The writer is the router's single asyncio thread (every hot-path caller runs on the event loop),
so no update is lost. A collect from another thread still reads a consistent histogram: it copies the bucket
counts in one C-level list copy (atomic under the GIL) and derives the cumulative buckets and ``_count`` from that
copy, so ``_count`` always equals the ``+Inf`` bucket and the buckets never decrease; only ``_sum`` may be one
concurrent observation ahead of or behind the counts (prometheus_client's own ``_sum`` and buckets are separate
locks too). The families are not safe with several writer threads, nor on a free-threaded interpreter.

Private prometheus_client names used (tests/test_fastmetrics.py catches a release that changes them):
``metrics._use_created`` (the created-series switch) and ``validation._validate_exemplar``/``_validate_labelname``.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final

import prometheus_client.metrics as _pm
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Exemplar, Sample
from prometheus_client.utils import floatToGoString
from prometheus_client.validation import _validate_exemplar, _validate_labelname, get_legacy_validation

_bisect_left: Final = bisect.bisect_left  # (Final: compiled, a C static instead of a module-dict lookup per use)

__all__ = ["CounterChild", "CounterFamily", "HistogramChild", "HistogramFamily"]

#: Exemplar label names already found valid, by prometheus_client's name rules at the time (legacy: True).
_VALID_EXEMPLAR_NAMES: dict[bool, set[str]] = {True: set(), False: set()}
#: What a child keeps of an exemplar until collect: (labels, value, time.time()); the Exemplar tuple is built at
#: collect (making one costs ~0.5 µs).
_Kept = tuple[dict[str, str], float, float]


def _check_exemplar(exemplar: dict[str, str]) -> None:
    """prometheus_client's exemplar check (label names valid, at most 128 characters in names and values; raises
    its ValueError), with the label-name check done once per name."""
    runes = 0
    valid = _VALID_EXEMPLAR_NAMES[get_legacy_validation()]
    for k, v in exemplar.items():
        if k not in valid:
            _validate_labelname(k)
            valid.add(k)
        runes += len(k) + len(v)
    if runes > 128:
        _validate_exemplar(exemplar)  # raises, with prometheus_client's message


def _exemplar(kept: _Kept | None) -> Exemplar | None:
    """The prometheus_client Exemplar of a kept one."""
    return None if kept is None else Exemplar(*kept)


class HistogramChild:
    """One label set of a :class:`HistogramFamily`: per-bucket (non-cumulative) counts, the sum, the exemplars."""

    __slots__ = ("_bounds", "_counts", "_created", "_exemplars", "_last", "_sum")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self._counts = [0.0] * len(bounds)
        self._sum = 0.0
        self._last = 0  # the bucket of the last value: the next one usually falls in it too
        self._exemplars: list[_Kept | None] = [None] * len(bounds)
        self._created = time.time()

    def observe(self, v: float, exemplar: dict[str, str] | None = None) -> None:
        """Count ``v`` in the first bucket with bound ≥ ``v`` and add it to the sum (a NaN: the sum only)."""
        self._sum += v
        if v != v:  # NaN: no bucket, as prometheus_client (its `v <= bound` is never true)
            return
        bounds = self._bounds
        i = self._last
        if v > bounds[i] or (i and v <= bounds[i - 1]):  # not the last value's bucket: search (compiled, the two
            i = self._last = _bisect_left(bounds, v)  # compares cost a tenth of the call)
        counts = self._counts
        counts[i] = counts[i] + 1.0
        if exemplar:
            _check_exemplar(exemplar)
            self._exemplars[i] = (exemplar, v, time.time())


class CounterChild:
    """One label set of a :class:`CounterFamily`: the value and its exemplar."""

    __slots__ = ("_created", "_exemplar", "_value")

    def __init__(self) -> None:
        self._value = 0.0
        self._exemplar: _Kept | None = None
        self._created = time.time()

    def inc(self, n: float = 1, exemplar: dict[str, str] | None = None) -> None:
        """Add ``n`` ≥ 0 (ValueError when negative)."""
        if n < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._value += n
        if exemplar:
            _check_exemplar(exemplar)
            self._exemplar = (exemplar, n, time.time())


class _Family:
    """The label-children cache and registration shared by both families."""

    _type = ""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str],
                 registry: CollectorRegistry | None) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Any] = {}
        if not self._labelnames:
            self._children[()] = self._new_child()
        if registry is not None:
            registry.register(self)

    def _new_child(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def collect(self) -> list[Metric]:  # pragma: no cover - overridden
        """The family's metric with every child's samples."""
        raise NotImplementedError

    def _key(self, values: tuple[Any, ...], by_name: dict[str, Any]) -> tuple[str, ...]:
        if values and by_name:
            raise ValueError("Can't pass both *args and **kwargs")
        if by_name:
            if sorted(by_name) != sorted(self._labelnames):
                raise ValueError("Incorrect label names")
            values = tuple(by_name[n] for n in self._labelnames)
        if len(values) != len(self._labelnames):
            raise ValueError("Incorrect label count")
        return tuple(str(v) for v in values)

    def _child(self, values: tuple[Any, ...], by_name: dict[str, Any]) -> Any:
        key = self._key(values, by_name)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def _only(self) -> Any:
        if self._labelnames:
            raise ValueError(f"{self._type} metric is missing label values")
        return self._children[()]

    def _label_dict(self, key: tuple[str, ...]) -> dict[str, str]:
        return dict(zip(self._labelnames, key, strict=True))


class HistogramFamily(_Family):
    """A histogram with prometheus_client's exposition and a cheap ``observe`` (see the module docstring).

    ``buckets``: upper bounds, sorted; ``+Inf`` is appended when missing (ValueError when unsorted or fewer than
    two bounds result). Raises ValueError when ``le`` is a label name.
    """

    _type = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (), *,
                 registry: CollectorRegistry | None = None, buckets: Sequence[float]) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if bounds and bounds[-1] != math.inf:
            bounds.append(math.inf)
        if len(bounds) < 2:
            raise ValueError("Must have at least two buckets")
        labelnames = tuple(labelnames)
        if "le" in labelnames:
            raise ValueError("Invalid label metric name: le")
        self._bounds = bounds
        self._les = [floatToGoString(b) for b in bounds]
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def labels(self, *values: Any, **by_name: Any) -> HistogramChild:
        """The child for these label values, made at zero on first use."""
        child: HistogramChild = self._child(values, by_name)
        return child

    def observe(self, v: float, exemplar: dict[str, str] | None = None) -> None:
        """``observe`` of the only child (ValueError when the family has label names)."""
        self._only().observe(v, exemplar)

    def describe(self) -> list[Metric]:
        """The family without samples (for the registry's duplicate-name check)."""
        return [HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> list[Metric]:
        """One HistogramMetricFamily with every child's samples (module docstring)."""
        name, les, use_created = self._name, self._les, _pm._use_created
        with_sum = self._bounds[0] >= 0
        fam = HistogramMetricFamily(name, self._documentation, labels=self._labelnames)
        add = fam.samples.append
        for key, child in self._children.copy().items():
            counts = list(child._counts)  # one atomic copy: _count and the buckets agree
            exemplars = list(child._exemplars)
            labels = self._label_dict(key)
            acc = 0.0
            for le, c, ex in zip(les, counts, exemplars, strict=True):
                acc += c
                add(Sample(name + "_bucket", {**labels, "le": le}, acc, None, _exemplar(ex)))
            add(Sample(name + "_count", labels, acc, None, None))
            if with_sum:
                add(Sample(name + "_sum", labels, child._sum, None, None))
            if use_created:
                add(Sample(name + "_created", labels, child._created, None, None))
        return [fam]


class CounterFamily(_Family):
    """A counter with prometheus_client's exposition and a cheap ``inc`` (see the module docstring)."""

    _type = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (), *,
                 registry: CollectorRegistry | None = None) -> None:
        super().__init__(name[:-6] if name.endswith("_total") else name, documentation, labelnames, registry)

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def labels(self, *values: Any, **by_name: Any) -> CounterChild:
        """The child for these label values, made at zero on first use."""
        child: CounterChild = self._child(values, by_name)
        return child

    def inc(self, n: float = 1, exemplar: dict[str, str] | None = None) -> None:
        """``inc`` of the only child (ValueError when the family has label names)."""
        self._only().inc(n, exemplar)

    def describe(self) -> list[Metric]:
        """The family without samples (for the registry's duplicate-name check)."""
        return [CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> list[Metric]:
        """One CounterMetricFamily with every child's ``_total`` (and ``_created``) sample."""
        use_created = _pm._use_created
        fam = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for key, child in self._children.copy().items():
            created = child._created if use_created else None
            fam.add_metric(key, child._value, created, exemplar=_exemplar(child._exemplar))
        return [fam]
