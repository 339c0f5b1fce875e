"""``dplb state``: the shared-memory segment as a table or JSON (what the seed did with ``cat | jq``).

Contract: read-only; the segment comes from ``--shm-path``, else ``$DPLB_SHM_PATH``, else the newest
``/dev/shm/dplb_state_*``. ``--json`` prints ``{"path", "header": {...}, "workers": [{...}, ...]}`` where each
worker has every slot field plus ``worker``, ``heartbeat_age_s`` (null if never written) and ``stale``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from dplb.config import PolicyConfig
from dplb.errors import DPLBError, ShmMissingError
from dplb.policy import routable
from dplb.shm import ENV_SHM_PATH, Segment, list_segments


def find_segment(path: str | None) -> str:
    """Resolve the segment path as described in the module docstring: the newest by its header's creation time
    (file mtimes do not move: workers write through mmap). Warns on stderr when several segments exist.
    Raises :class:`ShmMissingError`."""
    p = path or os.environ.get(ENV_SHM_PATH)
    if p:
        return p
    created = []
    for cand in list_segments():
        try:
            with Segment.attach(cand, writable=False) as seg:
                created.append((seg.header.created_unix_ns, cand))
        except DPLBError:
            continue
    if not created:
        raise ShmMissingError(None)
    created.sort(reverse=True)
    if len(created) > 1:
        others = ", ".join(c for _, c in created[1:])
        print(f"dplb state: several segments exist; showing the newest, {created[0][1]} (others: {others}). "
              "Pass --shm-path or set DPLB_SHM_PATH to pick one; `dplb doctor` finds stale ones.", file=sys.stderr)
    return created[0][1]


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
    return {"path": seg.path, "header": seg.header.to_dict(), "workers": workers}


def _gib(b: object) -> str:
    return f"{int(b) / (1 << 30):.1f}" if isinstance(b, int) else "-"


def render_table(snap: dict) -> object:
    """A rich Table of one snapshot (fits 80 columns; "!" after the lifecycle = stale heartbeat)."""
    from rich import box
    from rich.table import Table

    h = snap["header"]
    t = Table(title=f"{snap['path']}  model={h['model'] or '-'}  workers={h['num_workers']}  "
                    f"interval={h['state_interval_ms']} ms",
              caption="age, lat, TTFT, warm: seconds; lat, TTFT: mean of the last 10 requests",
              box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0))
    for col in ("id", "pid", "state", "age", "run", "wait", "KV%", "GPU GiB", "lat s", "TTFT", "reqs", "err",
                "OOM", "warm s"):
        t.add_column(col, justify="right", no_wrap=True)
    for w in snap["workers"]:
        age = w["heartbeat_age_s"]
        life = str(w["lifecycle"]) + ("!" if w["stale"] and w["pid"] else "")
        gpu = "-" if w["no_gpu"] else f"{_gib(w['gpu_memory_used_bytes'])}/{_gib(w['gpu_memory_total_bytes'])}"
        t.add_row(
            str(w["worker"]), str(w["pid"] or "-"), life, "-" if age is None else f"{age:.1f}",
            str(w["num_running"]), str(w["num_waiting"]), f"{100 * w['kv_cache_usage']:.1f}", gpu,
            f"{w['avg_latency_s']:.3f}", f"{w['avg_ttft_s']:.3f}", str(w["requests_total"]), str(w["errors_total"]),
            str(w["cuda_oom_total"]), f"{w['warmup_seconds']:.2f}",
        )
    return t


def run_state(path: str | None, *, as_json: bool, watch: bool, interval_s: float) -> int:
    """Print the segment once, or refresh it in place with ``watch``. Returns the exit code."""
    seg = Segment.attach(find_segment(path), writable=False)
    try:
        if as_json and not watch:
            print(json.dumps(snapshot(seg), indent=2))
            return 0
        from rich.console import Console
        from rich.live import Live

        console = Console()
        if not watch:
            console.print(render_table(snapshot(seg)))
            return 0
        with Live(render_table(snapshot(seg)), console=console, refresh_per_second=4) as live:  # type: ignore[arg-type]
            try:
                while True:
                    time.sleep(interval_s)
                    if as_json:
                        console.print_json(json.dumps(snapshot(seg)))
                    else:
                        live.update(render_table(snapshot(seg)))  # type: ignore[arg-type]
            except KeyboardInterrupt:
                return 0
    finally:
        seg.close()
