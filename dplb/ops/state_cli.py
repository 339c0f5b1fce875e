"""``dplb state``: the shared-memory segment as a table or JSON (what the seed did with ``cat | jq``).

Contract: read-only; the segment comes from ``--shm-path``, else ``$DPLB_SHM_PATH`` (as for ``dplb launch``), else
the only ``/dev/shm/dplb_state_*``; with several it refuses and lists them. The table's heading and the ``cpus``
line are their own lines, wrapped at the console's width (80 columns in a pipe), never cut; ``--watch`` redraws in
place on a terminal and, when stdout is a file or a pipe, appends one flushed frame per interval (JSON lines with
``--json``).
``--json`` prints ``{"path", "header": {...}, "workers": [{...}, ...], "routers": [{...}, ...]}`` where each
worker has every slot field plus ``worker``, ``heartbeat_age_s`` (null if never written), ``stale`` and
``router_inflight`` (open requests of every router process to it), ``progress_age_s`` (seconds since its engine
progress last moved; null when the engine cannot tell; ``why`` is ``stalled`` and the state column says so while
the worker's own stall check says so (its slot's ``FLAG_STALLED``, with the stack's ``--stall-after``), or when
requests are in flight and it is over the default ``--stall-after``); the table's state column says ``stale`` for
a registered worker whose heartbeat is stale while its lifecycle says it runs (:func:`state_word`), and a legend line
says what ``stale`` and ``stalled`` mean. Each router slot has its pid, port, process index, heartbeat age and
per-worker ``pending``/``inflight`` lists (:mod:`dplb.state.router_slots`).
Each live worker and router process also gets ``cpus``: the CPUs the kernel lets it run on (its affinity, read from
the pid on this host; null when it cannot be read), which is the placement ``dplb launch`` applied
(:mod:`dplb.ops.placement`); the table shows it on a line under the heading.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from typing import Any

from dplb.config import STALL_AFTER_S, PolicyConfig
from dplb.errors import ConfigError, ShmMissingError
from dplb.policy import routable
from dplb.policy.decision import WHY_STALE, WHY_STALLED
from dplb.runtime.cpus import format_cpu_list, process_cpus
from dplb.state.segments import segments
from dplb.state.shm import ENV_SHM_PATH, FLAG_STALLED, SHM_DIR, STALE_INTERVALS, Lifecycle, Segment

_ENDED = frozenset(x.name.lower() for x in (Lifecycle.UNSET, Lifecycle.STOPPED))  # not running: never "stale"


def find_segment(path: str | None, directory: str = SHM_DIR) -> str:
    """Resolve the segment path as described in the module docstring. With several segments and neither
    ``--shm-path`` nor ``$DPLB_SHM_PATH``, refuse (showing another stack's workers as yours is how one gets killed)
    and list each with its creator pid, routers and ports, run dir and liveness.
    Raises :class:`ShmMissingError` (none) or :class:`ConfigError` (several)."""
    p = path or os.environ.get(ENV_SHM_PATH)
    if p:
        return p
    found = segments(directory)
    readable = [i for i in found if i.header is not None]
    if not readable:
        raise ShmMissingError(None)
    if len(found) > 1:
        lines = "\n".join("  " + i.describe() for i in found)
        raise ConfigError(f"{len(found)} state segments exist; pass --shm-path (or set DPLB_SHM_PATH) to pick one:\n"
                          f"{lines}\n`dplb doctor` lists the stale ones and how to remove them.")
    return readable[0].path


def snapshot(seg: Segment) -> dict[str, object]:
    """The segment's header and every worker, JSON-friendly."""
    now = time.monotonic_ns()
    workers = []
    snap = seg.read_all()
    health = routable(snap, now, PolicyConfig(state_interval_ms=seg.state_interval_ms))  # the router's filters
    for s, c in zip(snap, health, strict=True):
        d = s.to_dict()
        age = s.age_s(now)
        d["worker"] = d.pop("worker_id")
        d["heartbeat_age_s"] = round(age, 3) if age != float("inf") else None
        d["stale"] = s.is_stale(seg.state_interval_ms, now)
        d["routable"], d["why"] = c.why == "ok", c.why
        workers.append(d)
    routers = seg.router_slots()
    for d in (*workers, *routers):
        pid = d.get("pid")
        d["cpus"] = process_cpus(pid) if isinstance(pid, int) and pid > 0 else None
    for k, d in enumerate(workers):  # open requests of every router process to this worker (their router slots)
        d["router_inflight"] = sum(r["inflight"][k] for r in routers)
        moved = snap[k].progress_mono_ns
        prog_age = max(0.0, (now - moved) / 1e9)
        d["progress_age_s"] = round(prog_age, 3) if moved else None
        # Stalled: the worker's own stall check (the router's rule with the stack's --stall-after), or for a worker
        # that does not run it, the rule from one look: requests in flight, no engine progress for the default.
        if d["routable"] and (snap[k].flags & FLAG_STALLED or (d["router_inflight"] and moved
                              and prog_age > STALL_AFTER_S)):
            d["routable"], d["why"] = False, WHY_STALLED
    return {"path": seg.path, "header": seg.header.to_dict(), "workers": workers, "routers": routers}


def _gib(b: object) -> str:
    return f"{int(b) / (1 << 30):.1f}" if isinstance(b, int) else "-"


def heading_text(snap: dict) -> str:
    """The table's heading line: segment path, model, workers, interval, routers (pid:port)."""
    h = snap["header"]
    routers = " ".join(f"{r['pid']}:{r['port']}" for r in h.get("routers", [])) or "-"
    return (f"{snap['path']}  model={h['model'] or '-'}  workers={h['num_workers']}  "
            f"interval={h['state_interval_ms']} ms  routers(pid:port)={routers}")


def _print(console: Any, snap: dict) -> None:
    """Print one frame; into a file or a pipe the console is as wide as the heading (never cut at 80 columns)."""
    if not console.is_terminal:
        console.width = max(80, len(heading_text(snap)), len(LEGEND), len(STATE_LEGEND))
    console.print(render_table(snap))


#: The lines under the table (left-aligned, whole in a pipe; a table caption was wrapped to the table and centred).
LEGEND = "age, lat, TTFT, warm: seconds; lat, TTFT: mean of the last 10 requests; rtr: in flight from the routers"
STATE_LEGEND = (f"state stale: no heartbeat for {STALE_INTERVALS} intervals (process dead or frozen); "
                "stalled: requests in flight, no engine progress")


def state_word(w: dict) -> str:
    """The table's state column for one worker of :func:`snapshot`: ``stalled``; ``stale`` for a registered worker
    whose heartbeat is stale while its lifecycle says it runs (starting, warming, ready, draining — ``--json`` keeps
    that lifecycle); else the lifecycle."""
    if w["why"] == WHY_STALLED:
        return WHY_STALLED
    life = str(w["lifecycle"])
    return WHY_STALE if w["stale"] and w["pid"] and life not in _ENDED else life


def render_table(snap: dict) -> object:
    """One snapshot as a rich renderable: a heading line, the ``cpus`` line, the table (fits 80 columns; the state
    column is :func:`state_word`), the two legend lines."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    heading = Text(heading_text(snap), style="bold", overflow="fold")
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0))
    for col in ("id", "pid", "state", "age", "run", "wait", "rtr", "KV%", "GPU GiB", "lat s", "TTFT", "reqs",
                "err", "OOM", "warm s"):
        t.add_column(col, justify="right", no_wrap=True)
    for w in snap["workers"]:
        age = w["heartbeat_age_s"]
        life = state_word(w)
        gpu = "-" if w["no_gpu"] else f"{_gib(w['gpu_memory_used_bytes'])}/{_gib(w['gpu_memory_total_bytes'])}"
        t.add_row(
            str(w["worker"]), str(w["pid"] or "-"), life, "-" if age is None else f"{age:.1f}",
            str(w["num_running"]), str(w["num_waiting"]), str(w.get("router_inflight", 0)),
            f"{100 * w['kv_cache_usage']:.1f}", gpu,
            f"{w['avg_latency_s']:.3f}", f"{w['avg_ttft_s']:.3f}", str(w["requests_total"]), str(w["errors_total"]),
            str(w["cuda_oom_total"]), f"{w['warmup_seconds']:.2f}",
        )
    return Group(heading, Text(placement_line(snap), overflow="fold"), t, Text(LEGEND), Text(STATE_LEGEND))


def placement_line(snap: dict) -> str:
    """``cpus: worker 0: 0-3 · worker 1: 4-7 · router 1234: 8-9`` (each live process's affinity; "?" unknown)."""
    def cpus(d: dict) -> str:
        return format_cpu_list(d["cpus"]) if d.get("cpus") else "?"
    parts = [f"worker {w['worker']}: {cpus(w)}" for w in snap["workers"] if w.get("pid")]
    parts += [f"router {r['pid']}: {cpus(r)}" for r in snap.get("routers", []) if r.get("pid")]
    return "cpus: " + (" · ".join(parts) if parts else "-")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_state(path: str | None, *, as_json: bool, watch: bool, interval_s: float, directory: str | None = None) -> int:
    """Print the segment once, or refresh it with ``watch`` until Ctrl-C/SIGTERM. Returns the exit code."""
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise ConfigError(f"--interval must be a finite number > 0 seconds, got {interval_s}")
    seg = Segment.attach(find_segment(path, directory or SHM_DIR), writable=False)
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout 3 dplb state --watch` ends like Ctrl-C
    try:
        if as_json and not watch:
            print(json.dumps(snapshot(seg), indent=2))
            return 0
        from rich.console import Console
        from rich.live import Live

        console = Console()
        if not watch:
            _print(console, snapshot(seg))
            return 0
        try:
            if as_json or not console.is_terminal:  # a file or a pipe: one flushed frame per interval
                while True:
                    if as_json:
                        print(json.dumps(snapshot(seg)), flush=True)
                    else:
                        _print(console, snapshot(seg))
                        console.file.flush()
                    time.sleep(interval_s)
            with Live(render_table(snapshot(seg)), console=console, refresh_per_second=4) as live:  # type: ignore[arg-type]
                while True:
                    time.sleep(interval_s)
                    live.update(render_table(snapshot(seg)))  # type: ignore[arg-type]
        except KeyboardInterrupt:
            return 0
    finally:
        seg.close()
