"""A router bug on the direct relay (dplb/router/direct.py) ends the request exactly as the ASGI path ends it: before
any response byte reached the client, the same bare OpenAI-shaped 500 (status, headers, body, the connection kept),
counted the same; after, the connection cut as on the ASGI path. Real router and sim worker; the faults are planted
by a ``--policy-plugin`` module at a chosen step, named by the request (the prompt for the decision's hooks, an
``x-fault`` header for the rest): the scorer, a pick hook, the response head, a body chunk, the accounting at the
end."""

from __future__ import annotations

import json
import os
import re
import socket
import textwrap
import time
from pathlib import Path

import pytest
from cluster import Cluster, cluster

from dplb import native

PLUGIN = '''
"""Faults planted in the router process on request (tests/test_direct_errors.py)."""
import gc

from dplb.policy import Scorer, register_scorer


class Boom(RuntimeError):
    pass


def fault(scope):
    for n, v in scope["headers"]:
        if n == b"x-fault":
            return v.decode()
    return ""


def relay_at(scope):
    """The body chunk to fail at: ``x-fault: relay-N`` (N), or 0."""
    f = fault(scope)
    return int(f[6:]) if f.startswith("relay-") else 0


ARMED = []  # x-fault: end seen at the head: the accounting of that attempt raises


def install():
    """Wrap the Upstreams' response-head hook (an attribute, compiled or not): x-fault: head raises there, and
    x-fault: end arms the accounting's fault."""
    from dplb.router.attempt import Upstreams

    gc.unfreeze()  # (the router froze its start-up objects: get_objects does not list frozen ones)
    found = gc.get_objects()
    gc.freeze()
    for o in found:
        if isinstance(o, Upstreams) and not getattr(o.on_response_head, "planted", False):
            prev = o.on_response_head

            def hook(scope, out, prev=prev):
                f = fault(scope)
                if f == "head":
                    raise Boom("head")
                if f == "end":
                    ARMED.append(1)
                if prev is not None:
                    prev(scope, out)

            hook.planted = True
            o.on_response_head = hook


class Fault(Scorer):
    name = "fault"

    def score(self, cands, ctx):
        install()
        if b"fault-score" in bytes(ctx.request.prompt or b""):
            raise Boom("score")
        return [0.0] * len(cands)

    def on_pick(self, request, worker, now_ns):
        if b"fault-on_pick" in bytes(request.prompt or b""):
            raise Boom("on_pick")


register_scorer(Fault)


def patch_pure():
    """The body and accounting faults: class patches, which a compiled build refuses (then not planted)."""
    from dplb.router.attempt import Attempt
    from dplb.router.state import RouterState
    from dplb.runtime.direct import DirectResponse

    body, write, bodies = DirectResponse.body, DirectResponse.write, DirectResponse._bodies
    relay, report = Attempt._relay_plain, RouterState.report

    def check(self, chunks):  # (one socket read's chunks: those before the failing one are framed, then it raises)
        n = relay_at(self.cycle.scope)
        if n:
            for data in chunks:
                self.cycle.fault_n = getattr(self.cycle, "fault_n", 0) + 1
                if self.cycle.fault_n >= n:
                    raise Boom("relay")
                body(self, data)
            chunks = []
        return chunks

    def direct_write(self, chunks):
        write(self, check(self, chunks))

    def direct_bodies(self, chunks):
        bodies(self, check(self, chunks))

    async def relay_plain(self, chunks):
        n = relay_at(self.ex.scope)
        if not n:
            return await relay(self, chunks)

        class Failing:
            def __init__(self):
                self.k = 0

            def __aiter__(self):
                return self

            async def __anext__(self):
                chunk = await chunks.__anext__()
                self.k += 1
                if self.k >= n:
                    raise Boom("relay")
                return chunk

        return await relay(self, Failing())

    def failing_report(self, worker, outcome, e2e_s=0.0, ttft_s=None):
        report(self, worker, outcome, e2e_s, ttft_s)
        if ARMED:
            ARMED.clear()
            raise Boom("end")

    DirectResponse.write, DirectResponse._bodies = direct_write, direct_bodies
    Attempt._relay_plain, RouterState.report = relay_plain, failing_report


try:
    patch_pure()
except TypeError:  # compiled classes
    pass
'''

PURE = not native.compiled_modules()
INTERNAL = b'{"error":{"message":"internal error","type":"server_error","param":null,"code":"internal_error"}}'


@pytest.fixture
def faulty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cluster:  # type: ignore[misc]
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / "fault_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.setenv("PYTHONPATH", f"{plug}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-chunk-delay-s", "0.02"]},
                 router_args=_args()) as c:
        yield c


def _args(*extra: str) -> list[str]:
    return ["--policy-plugin", "fault_plugin", "--weights", "queue=0.5,fault=0.5", *extra]


def _request(step: str, stream: bool = False) -> bytes:
    body = json.dumps({"model": "dplb-sim", "max_tokens": 12 if stream else 2, "stream": stream,
                       "messages": [{"role": "user", "content": f"fault-{step}"}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"x-request-id: rid-%s\r\nx-fault: %s\r\ncontent-length: %d\r\n\r\n" % (step.encode(), step.encode(),
                                                                                      len(body)) + body)


def _response(s: socket.socket) -> tuple[bytes, bool]:
    """One response from ``s``: (its bytes, whether the connection closed right after or within it)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = s.recv(65536)
        if not data:
            return buf, True
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    m = re.search(rb"(?i)\r\ncontent-length: (\d+)", head)
    end = (lambda b: len(b) >= int(m.group(1))) if m else (lambda b: b.endswith(b"0\r\n\r\n"))
    while not end(rest):
        data = s.recv(65536)
        if not data:
            return head + b"\r\n\r\n" + rest, True
        rest += data
    return head + b"\r\n\r\n" + rest, False


def _ask(c: Cluster, step: str, stream: bool = False) -> tuple[bytes, bytes]:
    """The faulty request on a fresh connection, then a plain one on the same connection: (the first answer, the
    second, b"" when the connection was closed after the first)."""
    with socket.create_connection(("127.0.0.1", c.port), timeout=15) as s:
        s.sendall(_request(step, stream))
        first, closed = _response(s)
        if closed:
            return first, b""
        try:
            s.sendall(_request("none"))
            return first, _response(s)[0]
        except OSError:
            return first, b""


def _count(c: Cluster, status: str) -> float:
    return c.metric("dplb_http_requests_total", {"method": "POST", "route": "/v1/chat/completions",
                                                 "status": status}) or 0.0


def _settled(c: Cluster) -> None:
    t0 = time.monotonic()
    while (v := c.metric("dplb_worker_requests_inflight", {"worker": "0"})) != 0:
        assert time.monotonic() - t0 < 5, f"in-flight stays {v}"
        time.sleep(0.05)


def _warm(c: Cluster) -> None:
    for _ in range(2):  # (a pooled connection: the direct relay takes the next request itself)
        assert _ask(c, "none")[0].startswith(b"HTTP/1.1 200")


BEFORE = ["score", "on_pick", "head"]


def test_a_bug_before_any_response_byte_is_the_asgi_paths_500(faulty: Cluster) -> None:
    """The scorer, a pick hook or the response-head step raising: byte for byte the ASGI path's 500 (X-Request-Id
    included), the connection kept alive, a 500 in the HTTP metrics, internal_error counted, nothing left in
    flight and the traceback logged. Before the fix, the direct relay closed the connection with no answer."""
    c = faulty
    answers = {}
    for path in ("direct", "asgi"):
        if path == "asgi":
            c.start_router(*_args("--no-direct-relay"))
        _warm(c)
        for step in BEFORE:
            before = _count(c, "500"), c.metric("dplb_requests_rejected_total", {"reason": "internal_error"}) or 0
            first, second = _ask(c, step)
            assert first.startswith(b"HTTP/1.1 500") and first.endswith(b"\r\n\r\n" + INTERNAL), (path, step, first)
            assert b"x-request-id: rid-" + step.encode() in first.lower(), first
            assert second.startswith(b"HTTP/1.1 200"), (path, step, second[:200])  # kept alive
            assert _count(c, "500") == before[0] + 1, (path, step)
            assert c.metric("dplb_requests_rejected_total", {"reason": "internal_error"}) == before[1] + 1
            _settled(c)
            answers[path, step] = first
        log = c.router_log()
        for step in BEFORE:
            assert f"Boom: {step}" in log, (path, step, c.tail())
    for step in BEFORE:
        assert answers["direct", step] == answers["asgi", step], step


@pytest.mark.skipif(not PURE, reason="the body and accounting faults patch classes: pure build only")
def test_a_bug_after_the_head_cuts_the_response_as_on_the_asgi_path(faulty: Cluster) -> None:
    """A body chunk raising mid-stream: the head and the chunks before it, then the connection cut (no terminating
    chunk, no [DONE]), counted with the worker's status, nothing left in flight, on both paths. The accounting
    raising after a complete answer: the answer whole, then the connection closed. On the direct relay a chunk
    that raises in the read that carried the head (nothing written yet) is the 500 instead."""
    c = faulty
    for path in ("direct", "asgi"):
        if path == "asgi":
            c.start_router(*_args("--no-direct-relay"))
        _warm(c)
        before = _count(c, "200")
        first, second = _ask(c, "relay-4", stream=True)
        assert first.startswith(b"HTTP/1.1 200") and second == b"", (path, first)
        assert first.count(b"data: ") >= 2 and b"[DONE]" not in first and not first.endswith(b"0\r\n\r\n"), first
        _settled(c)
        assert _count(c, "200") == before + 1, path
        first, second = _ask(c, "end")
        assert first.startswith(b"HTTP/1.1 200") and b'"choices"' in first and second == b"", (path, first)
        _settled(c)
        assert _count(c, "200") == before + 2, path
        log = c.router_log()
        assert "Boom: relay" in log and "Boom: end" in log, c.tail()
        if path == "direct":
            _warm(c)
            first, second = _ask(c, "relay-1")
            assert first.startswith(b"HTTP/1.1 500") and first.endswith(INTERNAL), first
            assert second.startswith(b"HTTP/1.1 200"), second[:200]
            _settled(c)
