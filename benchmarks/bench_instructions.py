"""CPU instructions per request of the router process, counted by valgrind (deterministic: a noisy shared box does
not move the figure the way it moves /proc CPU time).

What it does
- Workers: 2 fast sim engines (``bench_capacity.FAST_SIM``) around a real shm segment (``tests/cluster.py``).
- Router: ``dplb router`` (its defaults plus ``--router-flag`` flags) under ``valgrind --tool=callgrind
  --instr-atstart=no``: nothing is counted during start-up and the warm-up.
- Client: ``bench_capacity.Clients`` (one process, ``--concurrency`` keep-alive connections, one write per request).
  ``--warmup`` requests (200), then ``callgrind_control -i on`` and ``-z``, ``--requests`` requests (N, 1,000),
  ``-d`` (dump); then ``-z``, an idle window as long as the measured one, ``-d``. Instructions per request =
  (Ir of the load window − Ir of the idle window) ÷ N: the router's timers (the server's tick, the host report,
  state reads) are taken out. They run by the wall clock, so a box busy with other work (a longer window) moves
  the figure by ~1 % (net, idle taken out, a little low; gross, the load window alone, a little high): compare
  trees in alternating runs on the same box, and read both figures.
- Requests: ``POST /v1/completions`` with ``max_tokens`` ``--tokens`` (1: a plain JSON answer; more: an SSE stream,
  and the figure per streamed token is printed too: per request ÷ tokens).
- Socket reads per request (client and worker sides; uvloop's read callback, counted from the same dumps): a router
  slowed down by valgrind reads several of a stream's SSE chunks at once, which a router at full speed reads one
  by one, so a stream's figure depends on how many reads it took (4 to 25 for 65 chunks in unpaced runs). Pace the
  tokens with ``--worker-flag=--sim-decode-step-s=0.02`` (the sim's decode step, 20 ms) to read each chunk alone
  (~66 reads per 64-token request) and compare trees at the same count.
- ``--kv events|sent``: the workload of ``bench_capacity.py``'s KV targets (``KV_TARGETS``: ``dplb1kv`` /
  ``dplb1kvsent``): ``--workers`` sim workers (8 unless given) with a ``--kv-cache-blocks`` prefix cache (256),
  publishing their KV events and the router's index following them (``events``), or ``--no-kv-events`` and
  ``prefix.truth=sent`` (``sent``); the prompts are ``bench_capacity.prompts`` (``--prompt-words`` 256 from a pool
  of ``--prompt-pool`` 512). The KV-ring entries the workers published during the measured window (the ring heads,
  ``bench_capacity.kv_ring_heads``) are printed per request: what the router drained and applied.
- ``--profile``: no valgrind; the router runs under cProfile toggled by SIGUSR2 (this script's ``--_profiled``
  wrapper), the same two windows, and it prints Python function calls per request and the functions with the most.

Output: one line ``instructions/request: <k> k`` (and ``per token``; the gross figure in the parentheses) or
``calls/request``; ``--json`` adds the raw figures as one JSON line. ``--keep-dumps DIR``: the two windows' dumps
(callgrind's for ``callgrind_annotate``, cProfile's for ``pstats``). Errors: a failed request or a router that
does not come up raises (exit status 1); valgrind missing: exit status 2 with a message.

Usage: ``python benchmarks/bench_instructions.py [--requests 1000] [--tokens 1] [--router-flag=--no-direct-relay]
[--worker-flag=--sim-decode-step-s=0.02] [--kv events|sent] [--workers N] [--profile] [--json] [--api-key KEY]
[--tenants FILE]`` (``--api-key``: the clients send it as a bearer token; ``--tenants FILE``: the router's tenants
file, e.g. ``--tenants benchmarks/tenants-bench.toml --api-key benchkey1``). A 1,000-request
run takes ~15–30 s on a 2-core box (nothing is instrumented until the warm-up is over); ``--kv`` with 2,000 requests
after 600, ~50 s; 300 paced 64-token streams, ~70 s.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import pstats
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

_TOTALS = re.compile(rb"^(?:totals|summary):\s*(\d+)", re.M)
_FN = re.compile(rb"c?fn=\((\d+)\)(?: (.*))?$")
#: uvloop's callback for one read of a stream socket (client or worker side)
_READ_CB = b"__pyx_f_6uvloop_4loop___uv_stream_on_read"
_READY_S = 300.0  # a router under valgrind takes a minute or more to import and start


# ---- the router under a tool --------------------------------------------------------------------------------------
@contextlib.contextmanager
def stack(prefix: list[str], flags: list[str], env: dict[str, str] | None = None, workers: int = 2,
          worker_flags: tuple[str, ...] = ()) -> Iterator[Any]:
    """``workers`` fast sim workers (``FAST_SIM`` + ``worker_flags``) and a router run as ``prefix + python -m
    dplb.cli router ...``; yields (the Cluster, its temporary directory)."""
    import httpx
    from bench_capacity import FAST_SIM
    from cluster import Cluster, free_port, router_cmd

    from dplb.state.shm import Segment

    tmp = tempfile.mkdtemp(prefix="dplb-instr-")
    run_dir = os.path.join(tmp, "run")
    os.makedirs(run_dir, mode=0o700)
    c = Cluster(run_dir=run_dir, shm_path=f"/dev/shm/dplb_instr_{uuid.uuid4().hex[:10]}", num_workers=workers)
    c.segment = Segment.create(c.shm_path, workers, state_interval_ms=200, model="dplb-sim")
    try:
        for k in range(workers):
            c.start_worker(k, *FAST_SIM, *worker_flags, wait=False)
        for k in range(workers):
            c.wait_ready(k)
        c.port = free_port()
        log = open(os.path.join(run_dir, "router.log"), "ab")  # noqa: SIM115 - the process owns it
        c.logs.append(log.name)
        c.router = subprocess.Popen(
            [*prefix, *router_cmd("--host", c.host, "--port", str(c.port), "--run-dir", run_dir, *flags)],
            env={**c.env(), **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp)
        t0 = time.monotonic()
        while True:
            if c.router.poll() is not None:
                raise RuntimeError(f"router exited with {c.router.returncode}:\n{c.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(c.url + "/ready", timeout=5).status_code == 200:
                    break
            if time.monotonic() - t0 > _READY_S:
                raise TimeoutError(f"router not ready after {_READY_S:.0f} s:\n{c.tail()}")
            time.sleep(0.5)
        yield c, tmp
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _phase(clients: Any, n: int, tokens: int) -> float:
    """``n`` requests of ``tokens`` tokens; their wall seconds. Raises RuntimeError when any failed."""
    t0 = time.monotonic()
    got = clients.phase(n, tokens)
    if got["errors"] or got["requests"] != n:
        raise RuntimeError(f"{got['errors']:.0f} of {n} requests failed ({got['requests']:.0f} answered)")
    return time.monotonic() - t0


def kv_setup(a: argparse.Namespace) -> tuple[list[str], int, tuple[str, ...], int]:
    """(router flags, workers, worker flags, prompt words) of ``a``: ``--kv`` takes ``bench_capacity.KV_TARGETS``'s
    flags and the KV targets' prompts; without it, 2 workers (unless ``--workers``) and the short prompt. The
    ``--worker-flag`` flags come last (they override)."""
    from bench_capacity import KV_TARGETS

    if a.kv is None:
        return list(a.router_flag), a.workers or 2, tuple(a.worker_flag), 0
    flags, wflags = KV_TARGETS["dplb1kv" if a.kv == "events" else "dplb1kvsent"]
    return ([*flags, *a.router_flag], a.workers or 8,
            (*wflags, "--sim-prefix-cache-blocks", str(a.kv_cache_blocks), *a.worker_flag), a.prompt_words)


def windows(c: Any, a: argparse.Namespace, mark: Any, words: int = 0) -> tuple[float, float, int]:
    """Warm up, then ``mark("start")``, the measured requests (prompts of ``words`` words from ``a.prompt_pool``,
    ``bench_capacity.prompts``), ``mark("load")``, ``mark("start")``, an idle window as long, ``mark("idle")``.
    Returns (load seconds, idle seconds, KV-ring entries the workers published during the load window)."""
    from bench_capacity import Clients, kv_ring_heads

    clients = Clients(c.port, 1, a.concurrency, words, a.prompt_pool)
    try:
        _phase(clients, a.warmup, a.tokens)
        mark("start")
        e0 = kv_ring_heads(c.shm_path, c.num_workers)[0]
        load_s = _phase(clients, a.requests, a.tokens)
        entries = kv_ring_heads(c.shm_path, c.num_workers)[0] - e0
        mark("load")
        mark("start")
        time.sleep(load_s)
        mark("idle")
    finally:
        clients.close()
    return load_s, load_s, entries


# ---- callgrind ------------------------------------------------------------------------------------------------------
def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=120)


def _dump_total(out_dir: str, pid: int, seen: set[str]) -> tuple[int, int]:
    """(the Ir total, the socket reads: calls of uvloop's read callback) of the newest callgrind dump of ``pid``
    not in ``seen`` (waits for it to be written)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for path in sorted(glob.glob(os.path.join(out_dir, f"callgrind.out.{pid}*"))):
            if path in seen:
                continue
            with open(path, "rb") as f:
                text = f.read()
            m = _TOTALS.search(text)
            if m:
                seen.add(path)
                return int(m.group(1)), calls_to(text, _READ_CB)
        time.sleep(0.2)
    raise TimeoutError(f"no new callgrind dump of {pid} in {out_dir}")


def calls_to(dump: bytes, name: bytes) -> int:
    """Calls recorded in a callgrind dump to the function ``name`` (callgrind's ``cfn=`` / ``calls=`` lines; a
    name is written once, then referred to by its ``(id)``)."""
    names: dict[bytes, bytes] = {}
    callee = b""
    n = 0
    for line in dump.splitlines():
        if line.startswith((b"fn=", b"cfn=")):
            m = _FN.match(line)
            if m is not None:
                if m.group(2):
                    names[m.group(1)] = m.group(2)
                callee = names.get(m.group(1), b"") if line.startswith(b"cfn=") else b""
        elif line.startswith(b"calls=") and callee:
            if callee == name:
                n += int(line[6:].split()[0])
            callee = b""
    return n


def count_instructions(a: argparse.Namespace) -> dict[str, float]:
    """The callgrind measurement (module docstring); the figures."""
    out_dir = tempfile.mkdtemp(prefix="dplb-cg-")
    prefix = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-instr=no", "--dump-line=no",
              f"--callgrind-out-file={out_dir}/callgrind.out.%p"]
    totals: dict[str, tuple[int, int]] = {}
    try:
        flags, workers, wflags, words = kv_setup(a)
        with stack(prefix, flags, workers=workers, worker_flags=wflags) as (c, _):
            pid = c.router.pid
            seen = {p for p in glob.glob(os.path.join(out_dir, "*"))}
            state = {"on": False}

            def mark(what: str) -> None:
                if what == "start":
                    if not state["on"]:
                        _control(pid, "-i", "on")
                        state["on"] = True
                    _control(pid, "-z")
                else:
                    _control(pid, "-d")
                    totals[what] = _dump_total(out_dir, pid, seen)

            load_s, idle_s, entries = windows(c, a, mark, words)
    finally:
        if a.keep_dumps:
            shutil.copytree(out_dir, a.keep_dumps, dirs_exist_ok=True)
        shutil.rmtree(out_dir, ignore_errors=True)
    (ir_load, reads_load), (ir_idle, reads_idle) = totals["load"], totals["idle"]
    per_req = (ir_load - ir_idle) / a.requests
    return {"requests": a.requests, "tokens": a.tokens, "ir_load": ir_load, "ir_idle": ir_idle,
            "load_s": load_s, "idle_s": idle_s, "ir_per_request": per_req, "ir_per_token": per_req / a.tokens,
            "ir_gross_per_request": ir_load / a.requests, "workers": workers, "kv": a.kv,
            "kv_ring_entries": entries, "kv_entries_per_request": entries / a.requests,
            "reads_per_request": (reads_load - reads_idle) / a.requests}


# ---- cProfile -------------------------------------------------------------------------------------------------------
def _profiled(argv: list[str]) -> None:
    """Run ``ARGV`` (``python -m dplb.cli ...``) as ``dplb ...`` in this process with cProfile toggled by SIGUSR2:
    on (cleared), then off and dumped to ``$DPLB_PROFILE_OUT.<k>`` (k = 1, 2, …)."""
    import cProfile
    import runpy

    prof = cProfile.Profile()
    state = {"on": False, "k": 0}

    def toggle(signum: int, frame: Any) -> None:
        if not state["on"]:
            prof.clear()
            prof.enable()
        else:
            prof.disable()
            state["k"] += 1
            prof.dump_stats(f"{os.environ['DPLB_PROFILE_OUT']}.{state['k']}")
        state["on"] = not state["on"]

    signal.signal(signal.SIGUSR2, toggle)
    sys.argv = ["dplb", *argv[argv.index("dplb.cli") + 1:]]
    runpy.run_module("dplb.cli", run_name="__main__", alter_sys=True)


def count_calls(a: argparse.Namespace) -> dict[str, Any]:
    """The cProfile measurement: calls per request (load − idle) and the functions with the most."""
    out = os.path.join(tempfile.mkdtemp(prefix="dplb-prof-"), "prof")
    prefix = [sys.executable, __file__, "--_profiled"]
    stats: dict[str, pstats.Stats] = {}
    flags, workers, wflags, words = kv_setup(a)
    with stack(prefix, flags, env={"DPLB_PROFILE_OUT": out}, workers=workers, worker_flags=wflags) as (c, _):
        pid = c.router.pid
        k = [0]

        def mark(what: str) -> None:
            os.kill(pid, signal.SIGUSR2)
            if what != "start":
                k[0] += 1
                path = f"{out}.{k[0]}"
                deadline = time.monotonic() + 30
                while not os.path.exists(path) and time.monotonic() < deadline:
                    time.sleep(0.1)
                time.sleep(0.2)  # written whole
                stats[what] = pstats.Stats(path)

        windows(c, a, mark, words)
    if a.keep_dumps:
        shutil.copytree(os.path.dirname(out), a.keep_dumps, dirs_exist_ok=True)
    shutil.rmtree(os.path.dirname(out), ignore_errors=True)

    def calls(s: pstats.Stats) -> dict[str, int]:
        return {f"{f}:{line}({name})": v[1] for (f, line, name), v in s.stats.items()}  # type: ignore[attr-defined]

    load, idle = calls(stats["load"]), calls(stats["idle"])
    diff = {name: (n - idle.get(name, 0)) / a.requests for name, n in load.items()}
    top = sorted(diff.items(), key=lambda kv: -kv[1])[:a.top]
    total = (sum(load.values()) - sum(idle.values())) / a.requests
    return {"requests": a.requests, "tokens": a.tokens, "calls_per_request": total, "top": top}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="measured requests (1000)")
    ap.add_argument("--warmup", type=int, default=200, help="warm-up requests before counting (200)")
    ap.add_argument("--concurrency", type=int, default=16, help="keep-alive client connections (16)")
    ap.add_argument("--tokens", type=int, default=1, help="max_tokens per request; > 1 streams (SSE) (1)")
    ap.add_argument("--router-flag", action="append", default=[], help="an extra router flag (repeatable), e.g. "
                    "--router-flag=--no-direct-relay")
    ap.add_argument("--kv", choices=("events", "sent"), help="bench_capacity's KV-target workload: 8 workers with a "
                    "small prefix cache, KV events on and the index following them (events) or --no-kv-events and "
                    "prefix.truth=sent (sent), long prompts from a pool")
    ap.add_argument("--workers", type=int, help="sim workers (2; with --kv 8)")
    ap.add_argument("--worker-flag", action="append", default=[], help="an extra sim worker flag (repeatable), "
                    "e.g. --worker-flag=--sim-decode-step-s=0.01: tokens paced so that the router, slowed down by "
                    "valgrind, reads each SSE chunk alone (as it does at full speed) instead of several per read")
    ap.add_argument("--prompt-words", type=int, default=256, help="with --kv: words per prompt (256)")
    ap.add_argument("--prompt-pool", type=int, default=512, help="with --kv: distinct prompts sent in turn (512)")
    ap.add_argument("--kv-cache-blocks", type=int, default=256, help="with --kv: the sim prefix cache, blocks (256)")
    ap.add_argument("--profile", action="store_true", help="cProfile calls per request instead of instructions")
    ap.add_argument("--top", type=int, default=15, help="with --profile: how many functions to list (15)")
    ap.add_argument("--keep-dumps", metavar="DIR", help="copy the dumps (load: .1, idle: .2) to DIR: callgrind's "
                    "for callgrind_annotate, cProfile's for pstats")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    ap.add_argument("--api-key", help="send 'Authorization: Bearer KEY' (for --router-flag=--tenants=FILE or "
                    "--router-flag=--api-key=KEY)")
    ap.add_argument("--tenants", metavar="FILE", help="the router's --tenants FILE (with --api-key: a tenant's key; "
                    "benchmarks/tenants-bench.toml is the README's, key benchkey1)")
    a = ap.parse_args(argv)
    if a.tenants:
        a.router_flag.append(f"--tenants={os.path.abspath(a.tenants)}")
    if a.api_key:
        os.environ["DPLB_BENCH_API_KEY"] = a.api_key  # bench_capacity.ENV_API_KEY: the client processes send it
    if a.profile:
        r = count_calls(a)
        print(f"calls/request: {r['calls_per_request']:.1f} ({a.requests} requests, {a.tokens} token(s), kv "
              f"{a.kv or 'off'}, flags {a.router_flag or 'none'})")
        for name, n in r["top"]:
            print(f"  {n:8.2f}  {name}")
    else:
        if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
            print("bench_instructions: valgrind (with callgrind_control) is not installed", file=sys.stderr)
            return 2
        r = count_instructions(a)
        line = f"instructions/request: {r['ir_per_request'] / 1e3:.1f} k"
        if a.tokens > 1:
            line += f", per token: {r['ir_per_token'] / 1e3:.2f} k"
        print(f"{line} ({a.requests} requests, {a.tokens} token(s), {r['workers']} workers, kv {a.kv or 'off'}, "
              f"flags {a.router_flag or 'none'}; load window {r['load_s']:.1f} s, idle {r['ir_idle'] / 1e6:.1f} M of "
              f"{r['ir_load'] / 1e6:.1f} M; without the idle window {r['ir_gross_per_request'] / 1e3:.1f} k; "
              f"{r['reads_per_request']:.1f} socket reads per request)")
        if a.kv:
            print(f"KV-ring entries published in the load window: {r['kv_ring_entries']} "
                  f"({r['kv_entries_per_request']:.1f} per request)")
    if a.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_profiled":
        _profiled(sys.argv[2:])
    else:
        sys.exit(main())
