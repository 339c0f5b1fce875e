"""Shared building blocks of the DPLB dashboards (grafanalib). ``generate.py`` puts this directory on sys.path.

Conventions every dashboard follows (tests/test_dashboards.py checks them):
- schemaVersion 39 (Grafana 11/12); the data source is a ``DS_PROMETHEUS`` datasource variable and every panel and
  query names it as ``{"type": "prometheus", "uid": "${DS_PROMETHEUS}"}``; a ``stack`` variable (one stack: its
  router and its workers, by the ``stack`` target label that ``dplb launch``'s file_sd targets and the Kubernetes
  PodMonitor put on both jobs) and a ``worker`` variable (``label_values(dplb_worker_up{…router…}, worker)``, multi,
  All = ``.*``; ``worker="none"`` never shown).
- Metric names come from :mod:`dplb.obs.metrics` (never typed here), engine metrics are the ``vllm:*`` names the sim
  engine and vLLM both expose. Router series are scoped ``job="dplb-router"``, worker metrics ports
  ``job="dplb-workers"``; engine series carry no ``worker`` label, so :data:`WORKER_JOIN` adds it by ``instance``.
- Every panel sets a unit; panels are laid out by :class:`Layout` on the 24-column grid without overlaps.
"""

from __future__ import annotations

from typing import Any

from grafanalib.core import Dashboard as _Dashboard
from grafanalib.core import GridPos, RowPanel, Stat, StateTimeline, Template, Templating, Time, TimeSeries

from dplb.obs import metrics as M

DS: dict[str, str] = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# One stack at a time, router and workers alike by its stack label, so several routers never add up (three routers
# summed to 7 "routable workers" of 3) and two stacks on one host never share worker panels (the workers' address
# says nothing of their stack: a second stack on the same host, a router on 127.0.0.2 with workers on 127.0.0.1, or
# --emit-systemd's localhost router next to 127.0.0.1 workers).
ROUTER = 'job="dplb-router", stack="$stack"'
WORKERS = 'job="dplb-workers", stack="$stack"'
# worker="none" (decisions that found no worker) is not a worker: never a per-worker series.
SEL_W = 'worker=~"$worker", worker!="none"'
RI = "$__rate_interval"
PROXY_ROUTES = 'route=~"/v1/(chat/completions|completions|embeddings)"'

# Engine (vllm:*) series come from the worker's metrics port: one instance per worker, no worker label.
WORKER_JOIN = (f" * on (instance) group_left (worker) group by (instance, worker) "
               f"({M.WORKER_INFO}_info{{{WORKERS}, {SEL_W}}})")


def r(name: str, extra: str = "") -> str:
    """A router-scoped selector of ``name`` filtered by the worker variable (``extra``: more matchers)."""
    return f"{name}{{{ROUTER}, {SEL_W}{', ' + extra if extra else ''}}}"


def rate(sel: str) -> str:
    return f"rate({sel}[{RI}])"


def quantile(q: float, bucket_sel: str, by: str = "") -> str:
    """histogram_quantile over a rate of ``bucket_sel`` (a ``…_bucket{…}`` selector, or an expression)."""
    group = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) ({rate(bucket_sel)}))"


def engine(expr: str, agg: str = "sum by (worker)") -> str:
    """``agg`` over an engine (vllm:*) expression joined with its worker id."""
    return f"{agg} ({expr}{WORKER_JOIN})"


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "editorMode": "code", "expr": expr, "legendFormat": legend, "range": True,
            "refId": ref}


def targets(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [target(e, leg, chr(ord("A") + i)) for i, (e, leg) in enumerate(pairs)]


def ts(title: str, unit: str, tgts: list[dict[str, Any]], description: str, w: int = 12, h: int = 8,
       **kw: Any) -> TimeSeries:
    """A time-series panel (legend as a table with last and max)."""
    return TimeSeries(title=title, dataSource=DS, targets=tgts, unit=unit, description=description,
                      legendDisplayMode="table", legendPlacement="bottom", legendCalcs=["lastNotNull", "max"],
                      tooltipMode="multi", thresholds=[{"color": "green", "value": None}], maxDataPoints=None,
                      gridPos=GridPos(h=h, w=w, x=0, y=0), **kw)


def stat(title: str, unit: str, expr: str, description: str, w: int = 4, h: int = 4,
         steps: list[dict[str, Any]] | None = None, mappings: list[dict[str, Any]] | None = None) -> Stat:
    return Stat(title=title, dataSource=DS, targets=targets((expr, "")), format=unit, description=description,
                reduceCalc="lastNotNull", graphMode="none", colorMode="background", noValue="no data",
                thresholds=steps or [{"color": "green", "value": None}], mappings=mappings or [],
                maxDataPoints=None, gridPos=GridPos(h=h, w=w, x=0, y=0))


def lifecycle_timeline(description: str, w: int = 24, h: int = 6) -> StateTimeline:
    """One row per worker, coloured by lifecycle (the one-hot gauge folded into the state's index)."""
    parts = [r(M.WORKER_LIFECYCLE, 'state="' + s + '"') + f" * {i}" for i, s in enumerate(M.LIFECYCLE_STATES) if i]
    expr = "sum by (worker) (" + " or ".join(parts) + ")"
    colors = {"unset": "text", "starting": "blue", "warming": "yellow", "ready": "green", "draining": "orange",
              "stopped": "red"}
    mapping = {"type": "value", "options": {str(i): {"text": s, "color": colors[s], "index": i}
                                            for i, s in enumerate(M.LIFECYCLE_STATES)}}
    return StateTimeline(title="Worker lifecycle", dataSource=DS, targets=targets((expr, "worker {{worker}}")),
                         description=description, mappings=[mapping], colorMode="fixed", maxDataPoints=None,
                         thresholds=[{"color": "green", "value": None}],
                         extraJson={"fieldConfig": {"defaults": {"unit": "none"}}},
                         gridPos=GridPos(h=h, w=w, x=0, y=0))


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping lines; ``row()`` starts a titled row."""

    def __init__(self) -> None:
        self.panels: list[Any] = []
        self.x = self.y = self.line_h = 0

    def _newline(self) -> None:
        self.y += self.line_h
        self.x = self.line_h = 0

    def row(self, title: str) -> Layout:
        self._newline()
        self.panels.append(RowPanel(title=title, gridPos=GridPos(h=1, w=24, x=0, y=self.y)))
        self.y += 1
        return self

    def add(self, *panels: Any) -> Layout:
        for p in panels:
            w, h = p.gridPos.w, p.gridPos.h
            if self.x + w > 24:
                self._newline()
            p.gridPos = GridPos(h=h, w=w, x=self.x, y=self.y)
            self.x += w
            self.line_h = max(self.line_h, h)
            self.panels.append(p)
        return self


def variables() -> Templating:
    """DS_PROMETHEUS (current = the default data source, as @grafana/schema's VariableOption needs text and value),
    stack (one stack: the stack labels of the routers' build info), worker (multi, All)."""
    ds = Template(name="DS_PROMETHEUS", label="Data source", query="prometheus", type="datasource", refresh=1,
                  regex="")
    ds._current = {"selected": False, "text": "default", "value": "default"}
    build = f'{M.BUILD_INFO}_info{{job="dplb-router"}}'
    stack = Template(name="stack", label="Stack", query=f"label_values({build}, stack)", dataSource=DS,
                     includeAll=False, multi=False, refresh=2, sort=1, regex="")
    stack._current = {}
    worker = Template(name="worker", label="Worker", query=f"label_values({M.WORKER_UP}{{{ROUTER}}}, worker)",
                      dataSource=DS, includeAll=True, multi=True, allValue=".*", refresh=2, sort=3, regex="")
    worker._current = {"selected": True, "text": ["All"], "value": ["$__all"]}
    return Templating(list=[ds, stack, worker])


def make_dashboard(title: str, uid: str, description: str, layout: Layout) -> _Dashboard:
    return _Dashboard(title=title, uid=uid, description=description, tags=["dplb", "vllm"], panels=layout.panels,
                      templating=variables(), schemaVersion=39, refresh="30s", graphTooltip=1,
                      time=Time("now-1h", "now"), timezone="browser").auto_panel_ids()
