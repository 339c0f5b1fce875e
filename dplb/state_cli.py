"""``dplb state``: the shared-memory segment as a table or JSON (what the seed did with ``cat | jq``).

Contract: read-only; the segment comes from ``--shm-path``, else ``$DPLB_SHM_PATH``, else the newest
``/dev/shm/dplb_state_*``. ``--json`` prints ``{"path", "header": {...}, "workers": [{...}, ...]}`` where each
worker has every slot field plus ``worker``, ``heartbeat_age_s`` (null if never written) and ``stale``.
"""

from __future__ import annotations

import json
import os
import time

from dplb.errors import ShmMissingError
from dplb.shm import ENV_SHM_PATH, Segment, list_segments


def find_segment(path: str | None) -> str:
    """Resolve the segment path as described in the module docstring. Raises :class:`ShmMissingError`."""
    p = path or os.environ.get(ENV_SHM_PATH)
    if p:
        return p
    found = list_segments()
    if not found:
        raise ShmMissingError(None)
    return found[0]


def snapshot(seg: Segment) -> dict[str, object]:
    """The segment's header and every worker, JSON-friendly."""
    now = time.monotonic_ns()
    workers = []
    for s in seg.read_all():
        d = s.to_dict()
        age = s.age_s(now)
        d["worker"] = d.pop("worker_id")
        d["heartbeat_age_s"] = round(age, 3) if age != float("inf") else None
        d["stale"] = s.is_stale(seg.state_interval_ms, now)
        workers.append(d)
    return {"path": seg.path, "header": seg.header.to_dict(), "workers": workers}


def _gib(b: object) -> str:
    return f"{int(b) / (1 << 30):.1f}" if isinstance(b, int) else "-"


def render_table(snap: dict) -> object:
    """A rich Table of one snapshot."""
    from rich.table import Table

    h = snap["header"]
    t = Table(title=f"{snap['path']}  model={h['model'] or '-'}  workers={h['num_workers']}  "
                    f"interval={h['state_interval_ms']} ms")
    for col in ("id", "pid", "lifecycle", "age s", "running", "waiting", "KV %", "GPU mem GiB", "avg lat s",
                "TTFT s", "requests", "errors", "OOMs", "warm-up s"):
        t.add_column(col, justify="right")
    for w in snap["workers"]:
        age = w["heartbeat_age_s"]
        life = str(w["lifecycle"]) + (" (stale)" if w["stale"] and w["pid"] else "")
        gpu = "no GPU" if w["no_gpu"] else f"{_gib(w['gpu_memory_used_bytes'])}/{_gib(w['gpu_memory_total_bytes'])}"
        t.add_row(
            str(w["worker"]), str(w["pid"] or "-"), life, "-" if age is None else f"{age:.2f}",
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
