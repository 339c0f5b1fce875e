"""Router capacity benchmark: router CPU per request and per streamed token, and the most requests/s
and streamed tokens/s, for 1 and 2 DPLB router processes (and the SGLang router when installed), in one run.

Method
- Workers: fast sim engines (the ``FAST_SIM`` timing of ``bench_router.py``: 0.5 ms decode step + 0.02 ms per
  running sequence, no prefill cost, 256 batch slots), so the workers are never the queue.
  DPLB targets: ``dplb worker`` processes around a real shm segment (``tests/cluster.py``) and ``dplb router``
  with its defaults but ``--processes 1`` (the default is one per 8 cores); ``--processes 2`` (a supervisor parent
  and 2 children sharing the port with ``SO_REUSEPORT``)
  when ``dplb router --help`` lists it, else that case is printed as skipped.
  SGLang target (``pip install sglang-router``): the same sim engine served on TCP
  (``python -m dplb.worker.engines.sim --port P``; the SGLang router speaks HTTP to workers, not UDS) behind
  ``python -m sglang_router.launch_router`` with its default policy.
- Client: ``--clients`` separate processes (uvloop), each holding its share of ``--concurrency`` keep-alive
  HTTP/1.1 connections with a minimal asyncio.Protocol client (one write per request, TCP_NODELAY; a response is
  complete at its Content-Length or the last chunk; tokens = ``data: {`` events, counted once per response).
- Phases, per round, after a warm-up: ``--requests`` one-token completions (``max_tokens`` 1), then ``--streams``
  SSE completions of ``--tokens`` tokens each, both at ``--concurrency``. Around each phase the bench reads
  utime+stime from ``/proc/<pid>/stat`` of the router process **and all its descendants** (a multi-process router's
  children), of every worker, and the client processes report their own CPU time.
- Printed per target: router CPU µs per request (one-token phase CPU ÷ requests) and per streamed token
  (streaming phase CPU ÷ tokens; "beyond the request" also subtracts the per-request cost of the streams), both
  over all rounds together (``/proc`` counts 10 ms ticks), then medians over ``--rounds`` of requests/s and
  tokens/s (count ÷ phase wall time), and the CPU share of router, workers and client over the
  phase wall time in cores (``cores`` = this machine's). Capacity ratios 2 processes / 1 process come from the
  same run. Throughput is only the router's capacity when router CPU share is near one core per process and the
  client and workers had CPU to spare: read the shares before the ratios.

KV-event targets (the cost of ingesting the engines' KV-cache events, docs/DESIGN.md §3.7 and §5)
- ``dplb1kv``: one router process, ``--workers`` sim workers (8 unless given) with a small prefix cache
  (``--kv-cache-blocks``, 256 blocks of 16 tokens) publishing their KV events (``dplb worker --kv-events``, the
  default), the router's prefix index following them (``prefix.truth=events``, the default).
- ``dplb1kvsent``: the same workers and cache with ``--no-kv-events`` and the router on the sent-bytes index
  (``--scorer-param prefix.truth=sent``).
- Both send long prompts (``--prompt-words``, 256 words ≈ 16 engine blocks ≈ 12 router blocks of 128 bytes): a pool
  of ``--prompt-pool`` prompts, each one of 8 shared halves + its own half, sent in turn, so the working set
  (~8 × 512 blocks) is well beyond the 8 caches and every worker stores and evicts blocks all the time. Printed:
  the router CPU µs per request of each and ``kv − kvsent`` (paired by run with ``--repeat``): the added router
  cost of draining 8 busy workers' KV rings and applying their entries (budget ≤ 10 µs per request).

``--repeat N`` runs the listed targets N times, alternated (a, b, a, b, …: drift on the shared box hits both
alike), and prints each run's figures and the medians over the runs (the JSON holds both).

Usage: python benchmarks/bench_capacity.py [--quick] [--rounds 5] [--targets dplb1,dplb2,sglang] [--repeat N]
[--json OUT].
``--quick`` (smoke, < ~40 s): one round of 600 requests and 100 streams per target (coarse: few CPU ticks).
The machine is shared and noisy: router CPU µs per unit (from /proc) is steadier than throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

FAST_SIM = ["--sim-decode-step-s", "0.0005", "--sim-decode-step-s-per-seq", "0.00002",
            "--sim-prefill-s-per-token", "0", "--sim-max-num-seqs", "256"]
_TCK = os.sysconf("SC_CLK_TCK")


# ---- /proc CPU accounting -----------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime+stime seconds) of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TCK


def tree_cpu_s(root: int) -> float:
    """utime+stime seconds of ``root`` and every live descendant of it."""
    stats: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = _stat(int(name))
            if s is not None:
                stats[int(name)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo += children.get(pid, [])
    return total


# ---- the lean client (runs in --clients child processes) ----------------------------------------------------------
class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time; the response is handed back whole."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.buf = bytearray()
        self.body_at = -1
        self.length = -1  # Content-Length, or -1 = chunked
        self.waiter: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.body_at < 0:
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                return
            self.body_at = i + 4
            self.length = -1
            for line in bytes(buf[:i]).lower().split(b"\r\n")[1:]:
                if line.startswith(b"content-length:"):
                    self.length = int(line[15:])
        done = (len(buf) >= self.body_at + self.length) if self.length >= 0 else buf.endswith(b"0\r\n\r\n")
        if done and self.waiter is not None:
            out, self.buf, self.body_at = bytes(buf), bytearray(), -1
            self.waiter.set_result(out)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    async def request(self, raw: bytes) -> bytes:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.waiter


#: An API key the clients send as ``Authorization: Bearer`` (to measure a router with ``--tenants`` or ``--api-key``;
#: the client processes inherit it).
ENV_API_KEY = "DPLB_BENCH_API_KEY"


def _raw_request(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    key = os.environ.get(ENV_API_KEY)
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n{auth}"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


def prompts(words: int, pool: int, groups: int = 8) -> list[str]:
    """The KV targets' prompt pool: ``pool`` prompts of ``words`` words (0: the one short prompt ``"benchmark"``);
    prompt i is group ``i % groups``'s shared first half then a second half of its own (deterministic)."""
    if words <= 0:
        return ["benchmark"]
    half = words // 2
    shared = [" ".join(f"s{g}w{j}" for j in range(half)) for g in range(groups)]
    return [f"{shared[i % groups]} " + " ".join(f"p{i}w{j}" for j in range(words - half)) for i in range(pool)]


async def _drive(c: _Conn, connect: Any, raws: list[bytes], stream: bool, left: list[int],
                 got: dict[str, int]) -> None:
    """Send ``raws`` in turn (shared by every connection: the ``left[0]``-th from the end) on ``c`` while ``left[0]``
    > 0; count answers into ``got``."""
    while left[0] > 0:
        left[0] -= 1
        try:
            out = await c.request(raws[left[0] % len(raws)])
        except ConnectionError:
            got["errors"] += 1
            c = await connect()
            continue
        if not out.startswith(b"HTTP/1.1 200"):
            got["errors"] += 1
            continue
        got["requests"] += 1
        got["tokens"] += out.count(b"data: {") if stream else 1


async def _client_main(port: int, conns: int, words: int = 0, prompt_pool: int = 1) -> None:
    """Serve phase commands from stdin (``n tokens`` per line) on ``conns`` connections, the prompts of
    :func:`prompts` (``words``, ``prompt_pool``) in turn; one JSON line each."""
    loop = asyncio.get_running_loop()
    pool: list[_Conn] = []

    async def connect() -> _Conn:
        return (await loop.create_connection(_Conn, "127.0.0.1", port))[1]

    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        n, tokens = (int(x) for x in line.split())
        raws = []
        for text in prompts(words, prompt_pool):
            body: dict[str, Any] = {"model": "dplb-sim", "prompt": text, "max_tokens": tokens}
            if tokens > 1:
                body["stream"] = True
            raws.append(_raw_request("/v1/completions", body))
        got = {"requests": 0, "tokens": 0, "errors": 0}
        while len(pool) < conns:
            pool.append(await connect())
        pool = [c if not c.transport.is_closing() else await connect() for c in pool]
        c0, t0 = time.process_time(), time.perf_counter()
        left = [n]
        await asyncio.gather(*(_drive(c, connect, raws, tokens > 1, left, got) for c in pool))
        res: dict[str, float] = {**got, "cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0}
        sys.stdout.write(json.dumps(res) + "\n")
        sys.stdout.flush()


class Clients:
    """``k`` client processes driving ``port`` with ``concurrency`` connections in all, sending the prompts of
    :func:`prompts` (``words``, ``pool``)."""

    def __init__(self, port: int, k: int, concurrency: int, words: int = 0, pool: int = 1) -> None:
        self.procs = [subprocess.Popen([sys.executable, __file__, "--_client", str(port),
                                        str(concurrency // k + (i < concurrency % k)), str(words), str(pool)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE) for i in range(k)]

    def phase(self, n: int, tokens: int) -> dict[str, float]:
        k = len(self.procs)
        for i, p in enumerate(self.procs):
            assert p.stdin is not None
            p.stdin.write(f"{n // k + (i < n % k)} {tokens}\n".encode())
            p.stdin.flush()
        outs = []
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("a client process died")
            outs.append(json.loads(line))
        return {key: sum(o[key] for o in outs) for key in ("requests", "tokens", "errors", "cpu_s")}

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


# ---- targets --------------------------------------------------------------------------------------------------------
def dplb_has_processes() -> bool:
    """Whether ``dplb router --help`` lists ``--processes``."""
    from cluster import dplb_cmd

    out = subprocess.run(dplb_cmd("router", "--help"), capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=60).stdout
    return "--processes" in out


@contextlib.contextmanager
def dplb_target(workers: int, processes: int, flags: tuple[str, ...] = (),
                worker_flags: tuple[str, ...] = ()) -> Iterator[tuple[int, int, list[int], str | None]]:
    """A DPLB cluster (``flags``: more router flags; ``worker_flags``: more ``dplb worker`` and ``--sim-*`` flags):
    yields (port, router pid, worker pids, segment path)."""
    from cluster import cluster

    extra = [*flags, "--processes", str(processes)] if processes > 1 else list(flags)
    wargs = [*FAST_SIM, *worker_flags]
    with tempfile.TemporaryDirectory() as tmp, \
            cluster(tmp, workers, worker_args={k: wargs for k in range(workers)}, router_args=extra) as c:
        assert c.router is not None
        yield c.port, c.router.pid, [p.pid for p in c.workers.values()], c.shm_path


#: Router counters read after a DPLB target's run: short name → (metric, a label it must have or ""), summed.
ROUTER_COUNTERS = {
    "relay_direct": ("dplb_direct_relay_requests_total", 'path="direct"'),
    "relay_continued": ("dplb_direct_relay_requests_total", 'path="continued"'),
    "relay_declined": ("dplb_direct_relay_requests_total", 'path="declined"'),
    "prefix_hit": ("dplb_prefix_routed_total", 'outcome="hit"'),
    "prefix_spill": ("dplb_prefix_routed_total", 'outcome="spill"'),
    "prefix_miss": ("dplb_prefix_routed_total", 'outcome="miss"'),
    "kv_ring_lost": ("dplb_prefix_kv_ring_lost_total", ""),
    "index_blocks": ("dplb_prefix_index_blocks", ""),
    "decision_s": ("dplb_routing_decision_duration_seconds_sum", ""),  # the KV-ring drain and ingest included
    "decisions": ("dplb_routing_decision_duration_seconds_count", ""),
}


def router_counters(port: int) -> dict[str, float]:
    """:data:`ROUTER_COUNTERS` from the router's /metrics (what path the requests took, the prefix outcomes, the
    KV-ring entries it could not read, the index size); {} when it does not answer. Read after the measured phases."""
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        for key, (metric, label) in ROUTER_COUNTERS.items():
            if name == metric and label in rest:
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def kv_ring_heads(shm_path: str, workers: int) -> tuple[int, int]:
    """(KV-ring entries every worker wrote so far, summed; workers that translate their engine's events) of the
    segment at ``shm_path`` (the ring heads, :mod:`dplb.state.kv_rings`)."""
    from dplb.state.layout import KV_RING_SIZE, kv_rings_offset

    total = on = 0
    with open(shm_path, "rb") as f:
        for w in range(workers):
            head, since = struct.unpack("<QQ", os.pread(f.fileno(), 16, kv_rings_offset(workers) + w * KV_RING_SIZE))
            total += head
            on += since > 0
    return total, on


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not answering after {timeout} s")


@contextlib.contextmanager
def sglang_target(workers: int) -> Iterator[tuple[int, int, list[int], str | None]]:
    """Sim engines on TCP behind the SGLang router: yields (port, router pid, worker pids, None)."""
    from cluster import free_port

    sim_args = [a.replace("--sim-", "--") for a in FAST_SIM]
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "PYTHONPATH": ROOT}
    try:
        ports = [free_port() for _ in range(workers)]
        for p in ports:
            procs.append(subprocess.Popen([sys.executable, "-m", "dplb.worker.engines.sim", "--port", str(p),
                                           *sim_args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p, proc in zip(ports, procs, strict=True):
            _wait_http(f"http://127.0.0.1:{p}/health", 30, proc)
        port = free_port()
        router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                   "--port", str(port), "--log-level", "warn", "--worker-urls",
                                   *(f"http://127.0.0.1:{p}" for p in ports)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(router)
        _wait_http(f"http://127.0.0.1:{port}/health", 60, router)
        yield port, router.pid, [p.pid for p in procs[:-1]], None
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


# ---- measuring ------------------------------------------------------------------------------------------------------
def measure(port: int, router_pid: int, worker_pids: list[int], args: argparse.Namespace,
            words: int = 0) -> dict[str, float]:
    """Warm up, then ``args.rounds`` rounds of the two phases (prompts of ``words`` words, :func:`prompts`); medians
    of each figure."""
    clients = Clients(port, args.clients, args.concurrency, words, args.prompt_pool)
    cores = os.cpu_count() or 1
    rows: dict[str, list[float]] = {}
    phases: list[dict[str, float]] = []
    sent = [0]  # requests answered, warm-up included

    def phase(n: int, tokens: int) -> dict[str, float]:
        r0, w0, t0 = tree_cpu_s(router_pid), sum(tree_cpu_s(p) for p in worker_pids), time.perf_counter()
        got = clients.phase(n, tokens)
        wall = time.perf_counter() - t0
        r1, w1 = tree_cpu_s(router_pid), sum(tree_cpu_s(p) for p in worker_pids)
        if got["errors"]:
            raise RuntimeError(f"{got['errors']:.0f} of {n} requests failed")
        sent[0] += int(got["requests"])
        return {"router_cpu_s": r1 - r0, "worker_cpu_s": w1 - w0, "client_cpu_s": got["cpu_s"], "wall_s": wall,
                "requests": got["requests"], "tokens": got["tokens"]}

    try:
        phase(max(100, args.requests // 4), 1)
        phase(max(16, args.streams // 8), args.tokens)
        for _ in range(args.rounds):
            a = phase(args.requests, 1)
            b = phase(args.streams, args.tokens)
            phases += (a, b)
            per_req = a["router_cpu_s"] / a["requests"]
            row = {
                "req_us": per_req * 1e6,
                "tok_us": b["router_cpu_s"] / b["tokens"] * 1e6,
                "tok_marginal_us": (b["router_cpu_s"] - per_req * b["requests"]) / b["tokens"] * 1e6,
                "req_s": a["requests"] / a["wall_s"], "tok_s": b["tokens"] / b["wall_s"],
                "tokens_per_stream": b["tokens"] / b["requests"],
                "req_router_cores": a["router_cpu_s"] / a["wall_s"],
                "req_worker_cores": a["worker_cpu_s"] / a["wall_s"],
                "req_client_cores": a["client_cpu_s"] / a["wall_s"],
                "tok_router_cores": b["router_cpu_s"] / b["wall_s"],
                "tok_worker_cores": b["worker_cpu_s"] / b["wall_s"],
                "tok_client_cores": b["client_cpu_s"] / b["wall_s"],
            }
            for k, v in row.items():
                rows.setdefault(k, []).append(v)
    finally:
        clients.close()
    out = {k: statistics.median(v) for k, v in rows.items()}
    # CPU per unit over all rounds together: /proc/<pid>/stat counts in clock ticks (10 ms), so one round of
    # 1,200 requests is only ~15 ticks; the sum over the rounds is what the ticks resolve.
    a_cpu, a_n = sum(x["router_cpu_s"] for x in phases[0::2]), sum(x["requests"] for x in phases[0::2])
    b_cpu, b_n = sum(x["router_cpu_s"] for x in phases[1::2]), sum(x["requests"] for x in phases[1::2])
    b_tok = sum(x["tokens"] for x in phases[1::2])
    out["req_us"] = a_cpu / a_n * 1e6
    out["tok_us"] = b_cpu / b_tok * 1e6
    out["tok_marginal_us"] = (b_cpu - a_cpu / a_n * b_n) / b_tok * 1e6
    out["cores"] = cores
    out["rounds"] = args.rounds
    out["requests_total"] = sent[0]
    out["req_us_all"] = rows["req_us"]  # type: ignore[assignment]
    out["tok_us_all"] = rows["tok_us"]  # type: ignore[assignment]
    return out


#: KV-event targets → (router flags, worker flags beyond FAST_SIM and the small prefix cache).
KV_TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "dplb1kv": ((), ("--kv-events",)),
    "dplb1kvsent": (("--scorer-param", "prefix.truth=sent"), ("--no-kv-events",)),
}
KV_BUDGET_US = 10.0  # the most router CPU per request that ingesting 8 busy workers' KV events may add


def run_target(t: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """One measured run of target ``t`` (None when it is skipped, with a line saying why)."""
    if t == "dplb2" and not dplb_has_processes():
        print("dplb2: skipped (`dplb router --help` lists no --processes)")
        return None
    if t == "sglang" and shutil.which("sglang-router", path=os.path.dirname(sys.executable)) is None:
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            print("sglang: skipped (pip install sglang-router)")
            return None
    words = 0
    if t == "sglang":
        ctx = sglang_target(args.workers or 2)
    elif t in KV_TARGETS:
        flags, wflags = KV_TARGETS[t]
        words = args.prompt_words
        ctx = dplb_target(args.workers or 8, 1, flags,
                          (*wflags, "--sim-prefix-cache-blocks", str(args.kv_cache_blocks)))
    else:
        ctx = dplb_target(args.workers or 2, 2 if t == "dplb2" else 1,
                          ("--no-direct-relay",) if t == "dplb1asgi" else ())
    with ctx as (port, pid, wpids, shm):
        e0 = kv_ring_heads(shm, len(wpids))[0] if shm else 0
        r: dict[str, Any] = measure(port, pid, wpids, args, words)
        if shm:  # what the workers published for the router to ingest (0 with --no-kv-events)
            e1, on = kv_ring_heads(shm, len(wpids))
            r["kv_ring_entries"], r["kv_event_workers"] = e1 - e0, on
            r["kv_entries_per_request"] = (e1 - e0) / max(1, r["requests_total"])
            r["router_counters"] = router_counters(port)
    r["workers"] = len(wpids)
    print_target(t, r)
    return r


def print_target(t: str, r: dict[str, Any]) -> None:
    """The lines of one run of target ``t``."""
    print(f"--- {t}: router CPU {r['req_us']:.0f} µs/request, {r['tok_us']:.1f} µs/streamed token "
          f"({r['tok_marginal_us']:.1f} beyond the request); {r['req_s']:.0f} requests/s, {r['tok_s']:.0f} "
          f"tokens/s ({r['tokens_per_stream']:.1f} tokens/stream)")
    per_core = [f"{1e6 / r[k]:.0f}" if r[k] > 0 else "n/a (under one 10 ms tick)" for k in ("req_us", "tok_us")]
    print(f"    one router core's worth at that CPU cost: {per_core[0]} requests/s, {per_core[1]} tokens/s")
    print(f"    cores used (of {r['cores']}), one-token phase: router {r['req_router_cores']:.2f}, workers "
          f"{r['req_worker_cores']:.2f}, client {r['req_client_cores']:.2f}; streaming phase: router "
          f"{r['tok_router_cores']:.2f}, workers {r['tok_worker_cores']:.2f}, client {r['tok_client_cores']:.2f}")
    print(f"    per round µs/request {[round(x) for x in r['req_us_all']]}, µs/token "
          f"{[round(x, 1) for x in r['tok_us_all']]}")
    rc = r.get("router_counters")
    if rc:
        print(f"    router: {', '.join(f'{k} {v:g}' for k, v in rc.items() if k not in ('decision_s', 'decisions'))}")
        if rc.get("decisions"):
            print(f"    routing decision (wall, KV-ring drain and ingest included): "
                  f"{rc['decision_s'] / rc['decisions'] * 1e6:.1f} µs mean over {rc['decisions']:g}")
    if "kv_ring_entries" in r:
        print(f"    KV rings: {r['kv_ring_entries']} entries published ({r['kv_entries_per_request']:.1f} per request) "
              f"by {r['kv_event_workers']} of {r['workers']} workers following their engine's events")


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures as they are; several runs: the median of every number, and ``runs`` (each run's dict)."""
    if len(runs) == 1:
        return runs[0]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items()
                           if isinstance(v, int | float) and not isinstance(v, bool)}
    out["runs"] = runs
    return out


def print_repeats(results: dict[str, Any]) -> None:
    """Per target with several runs: each run's µs/request and µs/token, and their medians."""
    for t, r in results.items():
        runs = r.get("runs")
        if runs:
            print(f"=== {t}, {len(runs)} runs: µs/request {[round(x['req_us'], 1) for x in runs]} (median "
                  f"{r['req_us']:.1f}); µs/token {[round(x['tok_us'], 2) for x in runs]} (median {r['tok_us']:.2f})")


def kv_difference(results: dict[str, Any]) -> dict[str, Any] | None:
    """dplb1kv − dplb1kvsent router CPU µs per request: per run (paired in run order) and the median; printed.
    None unless both ran."""
    if "dplb1kv" not in results or "dplb1kvsent" not in results:
        return None
    kv, sent = results["dplb1kv"], results["dplb1kvsent"]
    pairs = list(zip(kv.get("runs", [kv]), sent.get("runs", [sent]), strict=False))
    diffs = [a["req_us"] - b["req_us"] for a, b in pairs]
    tok = [a["tok_us"] - b["tok_us"] for a, b in pairs]
    d = {"req_us": statistics.median(diffs), "req_us_all": diffs, "tok_us": statistics.median(tok),
         "tok_us_all": tok, "kv_req_us": kv["req_us"], "sent_req_us": sent["req_us"]}
    ok = d["req_us"] <= KV_BUDGET_US
    print(f"KV events, {kv.get('workers', '?')} workers: router CPU {kv['req_us']:.1f} µs/request following the "
          f"engines vs {sent['req_us']:.1f} on the sent-bytes index; kv − kvsent {d['req_us']:+.1f} µs/request "
          f"(per run {[round(x, 1) for x in diffs]}), {d['tok_us']:+.2f} µs/token; ≤ {KV_BUDGET_US:g} µs/request: "
          f"{'PASS' if ok else 'FAIL'}")
    return d


def print_comparisons(results: dict[str, Any]) -> None:
    """The targets against dplb1 (when it ran)."""
    if "dplb1" not in results:
        return
    one = results["dplb1"]
    ok_req, ok_tok = one["req_us"] <= 220, one["tok_us"] <= 25
    print(f"targets (1 process): µs/request ≤ 220: {'PASS' if ok_req else 'FAIL'} ({one['req_us']:.0f}); "
          f"µs/token ≤ 25: {'PASS' if ok_tok else 'FAIL'} ({one['tok_us']:.1f})")
    if "dplb2" in results:
        two = results["dplb2"]
        print(f"2 processes / 1: requests/s {two['req_s'] / one['req_s']:.2f}x, tokens/s "
              f"{two['tok_s'] / one['tok_s']:.2f}x (target ≥ 1.6x when client and workers have spare CPU)")
    for other, label in (("sglang", "DPLB / SGLang router CPU"),
                         ("dplb1asgi", "direct relay / ASGI path (--no-direct-relay) router CPU")):
        if other in results:
            o = results[other]
            print(f"{label}: per request {_ratio(one['req_us'], o['req_us'])}, per token "
                  f"{_ratio(one['tok_us'], o['tok_us'])}")


def _ratio(a: float, b: float) -> str:
    """``a / b`` as ``1.23x``; ``n/a`` when ``b`` is 0 (a figure under the CPU clock's 10 ms tick)."""
    return f"{a / b:.2f}x" if b else "n/a"

def main() -> int:
    if len(sys.argv) >= 4 and sys.argv[1] == "--_client":
        nums = [int(x) for x in sys.argv[2:]]
        try:
            import uvloop

            uvloop.run(_client_main(*nums))
        except ImportError:  # pragma: no cover
            asyncio.run(_client_main(*nums))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, small phases")
    ap.add_argument("--targets", default="dplb1,dplb2,sglang",
                    help="comma list of dplb1, dplb2, sglang, dplb1asgi (dplb1 with --no-direct-relay), dplb1kv, "
                    "dplb1kvsent (KV events on / off, see above)")
    ap.add_argument("--workers", type=int, help="sim workers per target (default 2; the KV targets 8)")
    ap.add_argument("--clients", type=int, default=1, help="client processes")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=1200, help="one-token requests per round")
    ap.add_argument("--streams", type=int, default=600, help="SSE streams per round")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1, help="run the targets this many times, alternated; medians")
    ap.add_argument("--prompt-words", type=int, default=256, help="words per prompt of the KV targets")
    ap.add_argument("--prompt-pool", type=int, default=512, help="distinct prompts the KV targets send in turn")
    ap.add_argument("--kv-cache-blocks", type=int, default=256, help="the KV targets' sim prefix cache, blocks")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    targets = args.targets.split(",")
    if args.quick:
        args.rounds, args.requests, args.streams = 1, 600, 100
    runs: dict[str, list[dict[str, Any]]] = {}
    for i in range(max(1, args.repeat)):
        if args.repeat > 1:
            print(f"##### run {i + 1} of {args.repeat}")
        for t in targets:
            r = run_target(t, args)
            if r is not None:
                runs.setdefault(t, []).append(r)
    results: dict[str, Any] = {t: combine(rs) for t, rs in runs.items()}
    print_repeats(results)
    print_comparisons(results)
    diff = kv_difference(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "kv_minus_kvsent": diff} if diff else results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
