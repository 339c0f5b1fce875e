"""Router overhead benchmark: the router vs talking to the worker's socket directly, in one run.

Starts one fast sim worker and a router in front of it (real processes), then measures with the same client:
- concurrency 1: added P50/P99 latency of a non-streaming completion (targets: ≤ 0.15 ms / ≤ 0.5 ms), against a
  worker whose sim answers as soon as its event loop runs (``INSTANT_SIM``): the fast sim's 0.5 ms step is slept
  on the event loop's millisecond timer, so with it the added figure also carries where the router's delay moves
  the request on that millisecond grid (both are printed: ``added_*`` and ``stepped_added_*``);
  a byte relay (``raw_relay.py``: one more process, no parsing) is measured in the same rounds: ``floor_added_*``
  is what any process in the path costs on this host, ``router_own_p50_ms`` the router's added P50 minus it;
- concurrency 32: requests/s ratio router/direct;
- 64 concurrent SSE streams: streamed tokens/s ratio router/direct (target ≥ 0.95);
- pick() share of the added time (from the router's dplb_routing_decision_duration_seconds).

Usage: python benchmarks/bench_router.py [--requests 400] [--tracing off|on|both] [--json OUT].
The machine is shared and noisy:
read medians and ratios, not absolute numbers. Rounds alternate direct/router to spread noise evenly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from cluster import cluster, free_port  # noqa: E402

BODY = {"model": "dplb-sim", "prompt": "benchmark", "max_tokens": 1}
FAST_SIM = ["--sim-decode-step-s", "0.0005", "--sim-decode-step-s-per-seq", "0.00002",
            "--sim-prefill-s-per-token", "0", "--sim-max-num-seqs", "256"]
#: A sim whose steps take no time (1 µs, rounded to no timer at all): what the concurrency-1 latency phase uses.
INSTANT_SIM = ["--sim-decode-step-s", "0.000001", "--sim-decode-step-s-per-seq", "0",
               "--sim-prefill-s-per-token", "0", "--sim-max-num-seqs", "256"]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


_RAW = json.dumps(BODY).encode()
_RAW_REQ = (b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(_RAW)) + _RAW


async def sequential(open_conn, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Concurrency 1 on one keep-alive connection with a minimal raw HTTP/1.1 client (one write per request,
    TCP_NODELAY), so the client's own cost does not drown the router's."""
    reader, writer = await open_conn()
    sock = writer.get_extra_info("socket")
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        writer.write(_RAW_REQ)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        out.append(time.perf_counter() - t0)
    writer.close()
    return out


async def throughput(client: httpx.AsyncClient, url: str, n: int, conc: int) -> float:
    sem = asyncio.Semaphore(conc)

    async def one() -> None:
        async with sem:
            r = await client.post(url, json=BODY)
            assert r.status_code == 200

    t0 = time.perf_counter()
    await asyncio.gather(*[one() for _ in range(n)])
    return n / (time.perf_counter() - t0)


async def sse(client: httpx.AsyncClient, url: str, streams: int, tokens: int) -> float:
    async def one() -> int:
        n = 0
        async with client.stream("POST", url, json={**BODY, "max_tokens": tokens, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    n += 1
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*[one() for _ in range(streams)])
    return sum(counts) / (time.perf_counter() - t0)


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of process ``pid`` to ``cpus`` (``sched_setaffinity`` binds one thread id)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


def place(c, relay_pid: int, cpu: int | None) -> str:  # type: ignore[no-untyped-def]
    """The production placement, when ``cpu`` is given: the router (and the byte relay it is compared with) on
    that CPU of its own, the client (this process) and the worker on the others; returns a one-line description."""
    if cpu is None:
        return "unpinned"
    rest = os.sched_getaffinity(0) - {cpu}
    if not rest or cpu not in os.sched_getaffinity(0):
        raise SystemExit(f"--router-cpu {cpu}: needs that CPU and at least one other in this process's affinity")
    assert c.router is not None
    for pid in (c.router.pid, relay_pid):
        pin(pid, {cpu})
    for pid in (c.workers[0].pid, os.getpid()):
        pin(pid, rest)
    return f"router and relay on CPU {cpu}; client and worker on CPUs {sorted(rest)}"


@contextlib.contextmanager
def raw_relay(sock: str) -> Iterator[tuple[int, int]]:
    """A :mod:`raw_relay` process in front of the worker's socket ``sock``; yields (its port, its pid)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "raw_relay.py"), str(port), sock],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "raw_relay did not start"
        yield port, proc.pid
    finally:
        proc.kill()
        proc.wait()


def _openers(c):  # type: ignore[no-untyped-def]
    """(open a connection to the worker's socket, open one to the router)."""
    return (lambda: asyncio.open_unix_connection(c.sock(0)),
            lambda: asyncio.open_connection("127.0.0.1", c.port))


async def latency(c, n: int, rounds: int, relay_port: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Concurrency 1, direct, routed and through the byte relay alternated by round: P50/P99 of each and the
    router's (and the relay's) added time."""
    open_direct, open_routed = _openers(c)

    def open_relay():  # type: ignore[no-untyped-def]
        return asyncio.open_connection("127.0.0.1", relay_port)

    for opener in (open_direct, open_routed, open_relay):
        await sequential(opener, 50)
    lat_d: list[float] = []
    lat_r: list[float] = []
    lat_f: list[float] = []
    for _ in range(rounds):
        lat_d += await sequential(open_direct, n // rounds)
        lat_r += await sequential(open_routed, n // rounds)
        lat_f += await sequential(open_relay, n // rounds)
    return {
        "floor_added_p50_ms": (pct(lat_f, 0.5) - pct(lat_d, 0.5)) * 1e3,
        "router_own_p50_ms": (pct(lat_r, 0.5) - pct(lat_f, 0.5)) * 1e3,
        "direct_p50_ms": pct(lat_d, 0.5) * 1e3, "router_p50_ms": pct(lat_r, 0.5) * 1e3,
        "direct_p99_ms": pct(lat_d, 0.99) * 1e3, "router_p99_ms": pct(lat_r, 0.99) * 1e3,
        "added_p50_ms": (pct(lat_r, 0.5) - pct(lat_d, 0.5)) * 1e3,
        "added_p99_ms": (pct(lat_r, 0.99) - pct(lat_d, 0.99)) * 1e3,
    }


async def run(c, n: int, rounds: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    direct = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=c.sock(0)), base_url="http://w", timeout=60,
                               limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
    # TCP_NODELAY on the client socket: without it Nagle + delayed ACK add milliseconds that are the client's.
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    routed = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(socket_options=nodelay), base_url=c.url,
                               timeout=60, limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
    path = "/v1/completions"
    open_direct, open_routed = _openers(c)
    await sequential(open_direct, 50)
    await sequential(open_routed, 50)
    lat_d: list[float] = []
    lat_r: list[float] = []
    rps_d, rps_r, tok_d, tok_r = [], [], [], []
    for _ in range(rounds):
        lat_d += await sequential(open_direct, n // rounds)
        lat_r += await sequential(open_routed, n // rounds)
        rps_d.append(await throughput(direct, path, n // 2, 32))
        rps_r.append(await throughput(routed, path, n // 2, 32))
        tok_d.append(await sse(direct, path, 64, 32))
        tok_r.append(await sse(routed, path, 64, 32))
    await direct.aclose()
    await routed.aclose()
    return {
        "stepped_direct_p50_ms": pct(lat_d, 0.5) * 1e3, "stepped_router_p50_ms": pct(lat_r, 0.5) * 1e3,
        "stepped_added_p50_ms": (pct(lat_r, 0.5) - pct(lat_d, 0.5)) * 1e3,
        "stepped_added_p99_ms": (pct(lat_r, 0.99) - pct(lat_d, 0.99)) * 1e3,
        "rps_direct_c32": statistics.median(rps_d), "rps_router_c32": statistics.median(rps_r),
        "rps_ratio_c32": statistics.median(rps_r) / statistics.median(rps_d),
        "sse_tok_s_direct": statistics.median(tok_d), "sse_tok_s_router": statistics.median(tok_r),
        "sse_ratio": statistics.median(tok_r) / statistics.median(tok_d),
    }


def one_mode(args: argparse.Namespace, tracing: bool) -> dict[str, float]:
    """Run the whole measurement with the router's tracing off or on (spans to a local OTLP receiver)."""
    rx = None
    if tracing:
        from otlp_receiver import OtlpReceiver

        rx = OtlpReceiver()
        os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = rx.endpoint + "/v1/traces"
    try:
        with tempfile.TemporaryDirectory() as tmp, cluster(tmp, 1, worker_args={0: INSTANT_SIM}) as c:
            with raw_relay(c.sock(0)) as (relay_port, relay_pid):
                mine = os.sched_getaffinity(0)
                placement = place(c, relay_pid, args.router_cpu)
                res = asyncio.run(latency(c, args.requests, args.rounds, relay_port))
                pin(os.getpid(), mine)
            dsum = c.metric("dplb_routing_decision_duration_seconds_sum") or 0.0
            dcnt = c.metric("dplb_routing_decision_duration_seconds_count") or 1.0
        print(f"concurrency-1 latency placement: {placement}")
        with tempfile.TemporaryDirectory() as tmp, cluster(tmp, 1, worker_args={0: FAST_SIM}) as c:
            res.update(asyncio.run(run(c, args.requests, args.rounds)))
    finally:
        os.environ.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
        if rx is not None:
            res_spans = len(rx.spans)
            rx.close()
    res["decision_mean_us"] = dsum / dcnt * 1e6
    res["pick_share_of_added"] = (dsum / dcnt) / (res["added_p50_ms"] / 1e3) if res["added_p50_ms"] > 0 else 0.0
    if rx is not None:
        res["spans_exported"] = res_spans
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tracing", choices=("off", "on", "both"), default="off",
                    help="router tracing (spans to a local OTLP receiver); both = two runs, compared")
    ap.add_argument("--router-cpu", type=int, default=None,
                    help="pin the router (and the byte relay) to this CPU and the client and worker to the others "
                         "for the concurrency-1 latency: the production placement, where the router has cores of "
                         "its own (default: unpinned, as the scheduler places them)")
    ap.add_argument("--json")
    args = ap.parse_args()
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.tracing]
    out = {}
    for tracing in modes:
        name = "tracing_on" if tracing else "tracing_off"
        res = out[name] = one_mode(args, tracing)
        print(f"--- {name}")
        for k, v in res.items():
            print(f"{k:24} {v:12.4f}")
        print(f"target added p50 ≤ 0.15 ms: {'PASS' if res['added_p50_ms'] <= 0.15 else 'FAIL'}; "
              f"added p99 ≤ 0.5 ms: {'PASS' if res['added_p99_ms'] <= 0.5 else 'FAIL'}; "
              f"SSE ratio ≥ 0.95: {'PASS' if res['sse_ratio'] >= 0.95 else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
