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
Each router slot also has ``tenants``: its tenant table (the limited tenants' open requests and counters a
``--processes N`` group shares so that limits hold group-wide, :mod:`dplb.state.tenant_tables`), one entry per
tenant with ``tag`` (the 56-bit tag in hex: the segment holds no names), ``name`` (from ``--tenants FILE``, else the
router's last good copy in the segment's run directory, which a router records in a header that has none; null when
neither names it: the table view then says to pass ``--tenants FILE``), ``inflight``, ``requests``,
``tokens_taken``, ``tokens_given`` and ``age_s`` (the counters start when the entry was made); ``tenants_file`` at the
top says which file named them (null: none). The table view sums them over the router slots on one ``tenants:`` line,
shown only when some slot has an entry (a single router process keeps none).
"""

from __future__ import annotations

import functools
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
from dplb.state.router_slots import ROUTER_STALE_S
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


def tenant_names(tenants: str | None, run_dir: str) -> tuple[dict[int, str], str | None]:
    """``{tag: name}`` of the tenants file that names the segment's tenant tables, and its path: ``tenants`` when
    given (:class:`ConfigError` when it does not load), else the router's last good copy in ``run_dir`` when one is
    there and loads (else ``({}, None)``)."""
    from dplb.tenants import last_good_path, load_tenants, tenant_tag

    path = tenants
    if path is None:
        path = last_good_path(run_dir) if run_dir else None
        if path is None or not os.path.isfile(path):
            return {}, None
        try:
            tc = load_tenants(path)
        except ConfigError:
            return {}, None
    else:
        tc = load_tenants(path)
    return {tenant_tag(n): n for n in tc.names()}, path


def _tag_hex(tag: int) -> str:
    return f"0x{tag:014x}"  # 56 bits: 14 hex digits


def snapshot(seg: Segment, names: dict[int, str] | None = None, tenants_file: str | None = None) -> dict[str, object]:
    """The segment's header, every worker and every router slot with its tenant table (``names``: ``{tag: name}``
    from ``tenants_file``, :func:`tenant_names`), JSON-friendly."""
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
    for r in routers:
        r["tenants"] = [{**e, "tag": _tag_hex(int(e["tag"])), "name": (names or {}).get(int(e["tag"]))}
                        for e in seg.tenant_table(r["slot"])]
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
    return {"path": seg.path, "header": seg.header.to_dict(), "workers": workers, "routers": routers,
            "tenants_file": tenants_file}


def _gib(b: object) -> str:
    return f"{int(b) / (1 << 30):.1f}" if isinstance(b, int) else "-"


def heading_text(snap: dict) -> str:
    """The table's heading line: segment path, model, workers, interval, routers (pid:port)."""
    h = snap["header"]
    routers = " ".join(f"{r['pid']}:{r['port']}" for r in h.get("routers", [])) or "-"
    return (f"{snap['path']}  model={h['model'] or '-'}  workers={h['num_workers']}  "
            f"interval={h['state_interval_ms']} ms  routers(pid:port)={routers}")


def _print(console: Any, snap: dict) -> None:
    """Print one frame; into a file or a pipe the console is as wide as its widest line (never cut at 80 columns)."""
    if not console.is_terminal:
        console.width = max(80, len(heading_text(snap)), len(LEGEND), len(STATE_LEGEND), len(tenants_line(snap) or ""))
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
    lines = [Text(LEGEND), Text(STATE_LEGEND)]
    if (tenants := tenants_line(snap)) is not None:
        lines.append(Text(tenants, overflow="fold"))
    return Group(heading, Text(placement_line(snap), overflow="fold"), t, *lines)


def tenants_line(snap: dict) -> str | None:
    """``tenants (group-wide limits, summed over 2 router processes' tables): chat 2 open, 14 admitted, 812 tokens
    · 0x00…: …``: each limited tenant's open requests, admitted requests and tokens (taken less given back) summed
    over the live router slots' tenant tables (heartbeat within ``ROUTER_STALE_S``, as the processes count them;
    every live one counted, with entries or not yet), by name where known, else by tag (then the line ends with how
    to name them); None when no live slot has an entry."""
    sums: dict[str, list[int]] = {}
    live = [r for r in snap.get("routers", []) if r["heartbeat_age_s"] is not None
            and r["heartbeat_age_s"] <= ROUTER_STALE_S]  # what the processes count (dplb.state.tenant_tables)
    unnamed = False
    for r in live:
        for e in r.get("tenants", []):
            unnamed |= e["name"] is None
            s = sums.setdefault(e["name"] or e["tag"], [0, 0, 0])
            s[0] += e["inflight"]
            s[1] += e["requests"]
            s[2] += e["tokens_taken"] - e["tokens_given"]
    if not sums:
        return None
    parts = [f"{k} {v[0]} open, {v[1]} admitted, {v[2]} tokens" for k, v in sums.items()]
    tables = "1 router process's table" if len(live) == 1 else f"{len(live)} router processes' tables"
    return (f"tenants (group-wide limits, summed over {tables}): " + " · ".join(parts)
            + (" (tags: pass --tenants FILE to name them)" if unnamed else ""))


def placement_line(snap: dict) -> str:
    """``cpus: worker 0: 0-3 · worker 1: 4-7 · router 1234: 8-9`` (each live process's affinity; "?" unknown)."""
    def cpus(d: dict) -> str:
        return format_cpu_list(d["cpus"]) if d.get("cpus") else "?"
    parts = [f"worker {w['worker']}: {cpus(w)}" for w in snap["workers"] if w.get("pid")]
    parts += [f"router {r['pid']}: {cpus(r)}" for r in snap.get("routers", []) if r.get("pid")]
    return "cpus: " + (" · ".join(parts) if parts else "-")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_state(path: str | None, *, as_json: bool, watch: bool, interval_s: float, directory: str | None = None,
              tenants: str | None = None) -> int:
    """Print the segment once, or refresh it with ``watch`` until Ctrl-C/SIGTERM (``tenants``: the tenants file
    naming the tenant tables, :func:`tenant_names`). Returns the exit code."""
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise ConfigError(f"--interval must be a finite number > 0 seconds, got {interval_s}")
    seg = Segment.attach(find_segment(path, directory or SHM_DIR), writable=False)
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout 3 dplb state --watch` ends like Ctrl-C
    try:
        names, names_from = tenant_names(tenants, seg.header.run_dir)
        frame = functools.partial(snapshot, names=names, tenants_file=names_from)  # each frame names them alike

        if as_json and not watch:
            print(json.dumps(frame(seg), indent=2))
            return 0
        from rich.console import Console
        from rich.live import Live

        console = Console()
        if not watch:
            _print(console, frame(seg))
            return 0
        try:
            if as_json or not console.is_terminal:  # a file or a pipe: one flushed frame per interval
                while True:
                    if as_json:
                        print(json.dumps(frame(seg)), flush=True)
                    else:
                        _print(console, frame(seg))
                        console.file.flush()
                    time.sleep(interval_s)
            with Live(render_table(frame(seg)), console=console, refresh_per_second=4) as live:  # type: ignore[arg-type]
                while True:
                    time.sleep(interval_s)
                    live.update(render_table(frame(seg)))  # type: ignore[arg-type]
        except KeyboardInterrupt:
            return 0
    finally:
        seg.close()
