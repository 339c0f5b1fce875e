"""Protocol-level fuzz of the direct relay's parser path (dplb/runtime/serving.py, dplb/router/direct.py): raw bytes
over real sockets to a real router with the relay on, each input also sent to a router with ``--no-direct-relay``
(the ASGI path, the oracle).

Inputs (hypothesis): valid POSTs with random JSON bodies cut at random chunk boundaries, pipelined pairs, random
header-name case, ``Content-Length`` or chunked framing; and bad input: bad and duplicate ``Content-Length``,
truncated heads and bodies, garbage bytes, oversize heads, a valid request followed by garbage.

Invariants: every response is a complete HTTP/1.1 message and no 5xx is router-made; a valid request gets exactly
one response, in order, with its own ``X-Request-Id`` and the status (and error code) the ASGI path gives, unless
an earlier answer closed the connection; bad input gets only 4xx answers, then a closed connection; nothing waits
past the read timeout; afterwards both routers answer ``/health``, nothing is in flight, no traceback was logged and
the relay router holds no more descriptors than before.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from cluster import Routers, both_paths, settled_fds, wait_for
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

BODY_LIMIT = 4096  # under the relay's 64 KiB offer: the 413 of both paths is exercised
READ_TIMEOUT_S = 10.0  # no answer, and no close, by then: a hang
FAST = ["--sim-decode-step-s", "0.0005", "--sim-decode-step-s-per-seq", "0", "--sim-max-model-len", "256"]


@pytest.fixture(scope="module")
def routers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routers]:
    """One sim worker and a router with the relay on; the same with ``--no-direct-relay``."""
    with both_paths(tmp_path_factory, ["--max-body-bytes", str(BODY_LIMIT)], {0: FAST}) as rs:
        yield rs


# ---- a minimal HTTP/1.1 response reader ---------------------------------------------------------------------------
@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-case names; the last value of a repeated one
    body: bytes

    def code(self) -> str | None:
        """The OpenAI error code of a JSON error body, else None."""
        if self.status < 400 or not self.body.startswith(b"{"):
            return None
        try:
            return str(json.loads(self.body)["error"]["code"])
        except (ValueError, KeyError, TypeError):
            return None


def _parse(buf: bytes) -> tuple[Response | None, bytes]:
    """The first complete response in ``buf`` and the rest, or (None, buf) while it is incomplete. Raises
    AssertionError on bytes that are not an HTTP/1.1 response."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None, buf
    lines = buf[:end].split(b"\r\n")
    assert lines[0].startswith(b"HTTP/1.1 "), buf[:200]
    status = int(lines[0][9:12])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode()] = value.strip().decode("latin-1")
    rest = buf[end + 4:]
    if "content-length" in headers:
        n = int(headers["content-length"])
        return (Response(status, headers, rest[:n]), rest[n:]) if len(rest) >= n else (None, buf)
    if headers.get("transfer-encoding") == "chunked":
        body, i = b"", 0
        while True:
            j = rest.find(b"\r\n", i)
            if j < 0:
                return None, buf
            size = int(rest[i:j], 16)
            if len(rest) < j + 2 + size + 2:
                return None, buf
            if size == 0:
                return Response(status, headers, body), rest[j + 4:]
            body += rest[j + 2:j + 2 + size]
            i = j + 2 + size + 2
    assert status in (204, 304) or status < 200, headers  # no framing: no body
    return Response(status, headers, b""), rest


def exchange(port: int, pieces: list[bytes], expect: int | None, eof: bool = False) -> tuple[list[Response], bool]:
    """Send ``pieces`` (one write each) on a new connection, ``eof``: then shut the write side. Read until
    ``expect`` responses came (None: until the router closes). Returns (responses, closed). Fails on a hang (no
    progress for :data:`READ_TIMEOUT_S`), on bytes that are not a complete response and on a close mid-response."""
    out: list[Response] = []
    closed = False
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for i, p in enumerate(pieces):
                if i:
                    time.sleep(0.001)  # separate reads on the router's side, most of the time
                s.sendall(p)
            if eof:
                s.shutdown(socket.SHUT_WR)
        except OSError:  # the router answered and closed before all was sent (a 400 / 431 / 413)
            pass
        buf = b""
        while expect is None or len(out) < expect:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                raise AssertionError(f"no answer and no close in {READ_TIMEOUT_S} s; got {out}, {buf[:200]!r}") \
                    from None
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                closed = True
                break
            buf += chunk
            while (r := _parse(buf)[0]) is not None:
                out.append(r)
                buf = _parse(buf)[1]
        assert not buf, f"a response cut short or stray bytes: {buf[:300]!r}"
    return out, closed


# ---- inputs -----------------------------------------------------------------------------------------------------
names = ["Content-Type", "Content-Length", "Host", "X-Request-Id", "Transfer-Encoding", "Connection"]
case = st.sampled_from([str.lower, str.upper, str.title, lambda s: s.swapcase()])
text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x2FF), max_size=40)
junk = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | text,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)
fields = st.fixed_dictionaries({
    "model": st.sampled_from(["dplb-sim", "dplb-sim", "no-such-model"]),
    "max_tokens": st.sampled_from([1, 2, 3, 1, 2, 3, 0, -1, "x"]),  # the last three: the worker's 400
}, optional={"stream": st.booleans(), "temperature": st.floats(0, 2), "extra": junk, "user": text})
json_body = st.one_of(
    st.builds(lambda f, p: json.dumps({**f, "prompt": p}).encode(), fields, text),
    st.builds(lambda f, p: json.dumps({**f, "messages": [{"role": "user", "content": p}]}).encode(), fields, text),
)
body = json_body | json_body | json_body | st.sampled_from([b"not json", b"[1, 2]", b"", b'{"model": "dplb-sim", "prompt": "' + b"x" * 5000
                                    + b'", "max_tokens": 1}', b'{"model": 1e999}'])
ctype = st.sampled_from(["application/json"] * 3 + ["Application/JSON; charset=utf-8", "text/plain", None])


@st.composite
def request(draw: Any, rid: str) -> bytes:
    """One complete, well-framed request (its status is the path's to decide, not the framing's)."""
    data = draw(body)
    path = "/v1/chat/completions" if b'"messages"' in data else "/v1/completions"
    cased = draw(case)
    head = [f"POST {path} HTTP/1.1", f"{cased('Host')}: fuzz", f"{cased('X-Request-Id')}: {rid}"]
    if (ct := draw(ctype)) is not None:
        head.append(f"{cased('Content-Type')}: {ct}")
    if draw(st.integers(0, 3)):  # Content-Length 3 times in 4: the relay's case
        head.append(f"{cased('Content-Length')}: {len(data)}")
        framed = data
    else:
        head.append(f"{cased('Transfer-Encoding')}: chunked")
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=3))) if data else []
        parts = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)], strict=True) if data[i:j]]
        framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return ("\r\n".join(head) + "\r\n\r\n").encode() + framed


def split(draw: Any, data: bytes) -> list[bytes]:
    """``data`` cut at up to 4 random places."""
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=4)))
    return [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)], strict=True) if data[i:j]]


@st.composite
def valid(draw: Any) -> tuple[list[bytes], list[str]]:
    """One request or a pipelined pair, cut into random pieces; (pieces, their request ids)."""
    rids = [f"fz-{draw(st.integers(0, 10**9))}-{i}" for i in range(draw(st.sampled_from([1, 1, 2])))]
    return split(draw, b"".join(draw(request(r)) for r in rids)), rids


HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: fuzz\r\ncontent-type: application/json\r\n"
OK_BODY = b'{"model": "dplb-sim", "prompt": "p", "max_tokens": 1}'
#: A body over the routers' BODY_LIMIT, sent whole: the 413 every run reaches (the generated cases reach it by chance).
BIG_BODY = b'{"model": "dplb-sim", "prompt": "' + b"x" * 5000 + b'", "max_tokens": 1}'
TOO_BIG = ([HEAD + b"x-request-id: fz-big-0\r\ncontent-length: %d\r\n\r\n" % len(BIG_BODY) + BIG_BODY], ["fz-big-0"])


@st.composite
def malformed(draw: Any) -> tuple[str, list[bytes], bool]:
    """Bad input; (its kind, pieces, shut the write side after them)."""
    n = len(OK_BODY)
    kind = draw(st.sampled_from(["clen", "dup", "trunc-head", "trunc-body", "garbage", "oversize", "then-garbage",
                                 "clen-and-chunked"]))
    if kind == "clen":
        value = draw(st.sampled_from([b"abc", b"-5", b"1e3", b"0x10", b" ", b"99999999999999999999999", b"+5"]))
        return kind, split(draw, HEAD + b"content-length: " + value + b"\r\n\r\n" + OK_BODY), True
    if kind == "dup":
        a, b = draw(st.sampled_from([(n, n), (n, n + 1), (n, 0), (0, n)]))
        return kind, split(draw, HEAD + b"content-length: %d\r\nContent-Length: %d\r\n\r\n" % (a, b) + OK_BODY), True
    if kind == "trunc-head":
        full = HEAD + b"content-length: %d\r\n\r\n" % n
        return kind, split(draw, full[:draw(st.integers(1, len(full) - 1))]), True
    if kind == "trunc-body":
        return kind, split(draw, HEAD + b"content-length: %d\r\n\r\n" % n + OK_BODY[:draw(st.integers(0, n - 1))]), True
    if kind == "garbage":
        return kind, split(draw, draw(st.binary(min_size=1, max_size=200))), True
    if kind == "oversize":
        size = draw(st.sampled_from([70_000, 200_000]))
        return kind, split(draw, HEAD + b"x-big: " + b"a" * size + b"\r\ncontent-length: %d\r\n\r\n" % n + OK_BODY), False
    if kind == "then-garbage":
        ok = HEAD + b"content-length: %d\r\n\r\n" % n + OK_BODY
        return kind, split(draw, ok + draw(st.sampled_from([b"GARBAGE\r\n\r\n", b"\x00\x01\x02\r\n\r\n",
                                                      b"POST / HTTP/9.9\r\n\r\n"]))), False
    return kind, split(draw, HEAD + b"content-length: %d\r\ntransfer-encoding: chunked\r\n\r\n" % n + OK_BODY), True


def _answers(rs: list[Response]) -> list[tuple[int, str | None]]:
    return [(r.status, r.code()) for r in rs]


def _no_router_5xx(rs: list[Response]) -> None:
    for r in rs:
        assert r.status < 500 or "x-sg-worker-id" in r.headers, (r.status, r.body[:300])


def _length_framed(pieces: list[bytes]) -> bool:
    """Whether the first request in ``pieces`` has a ``Content-Length`` header (its head's header names)."""
    head = b"".join(pieces).partition(b"\r\n\r\n")[0]
    return any(line.partition(b":")[0].strip().lower() == b"content-length" for line in head.split(b"\r\n")[1:])


def _quiet(rs: Routers) -> None:
    for c in (rs.direct, rs.asgi):
        wait_for(lambda c=c: c.metric("dplb_worker_requests_inflight", {"worker": "0"}) == 0, 10, "in-flight 0")


def test_fuzz_the_direct_relay_parser_path(routers: Routers) -> None:
    d, a = routers.direct, routers.asgi
    pid = d.router.pid  # type: ignore[union-attr]
    for c in (d, a):  # a pooled worker connection, so the relay serves (not continues) what follows
        assert httpx.post(c.url + "/v1/completions", content=OK_BODY, timeout=30).status_code == 200
    fds0 = settled_fds(pid)
    seen: dict[str, int] = {}
    due = 0  # first requests on their connection with a Content-Length that a worker answered: the relay's to take

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=valid())
    @example(case=TOO_BIG)
    def good(case: tuple[list[bytes], list[str]]) -> None:
        nonlocal due
        pieces, rids = case
        got, _ = exchange(d.port, pieces, len(rids))
        want, _ = exchange(a.port, pieces, len(rids))
        _no_router_5xx(got)
        assert _answers(got) == _answers(want), (pieces, got, want)
        # One answer per request, in order; fewer only when an answer closed the connection.
        assert [r.headers.get("x-request-id") for r in got] == rids[:len(got)], got
        if len(got) < len(rids):
            assert got and got[-1].headers.get("connection") == "close", got
        for r in got:
            seen[str(r.status)] = seen.get(str(r.status), 0) + 1
        due += bool(got) and "x-sg-worker-id" in got[0].headers and _length_framed(pieces)

    @settings(max_examples=120, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=malformed())
    def bad(case: tuple[str, list[bytes], bool]) -> None:
        kind, pieces, eof = case
        got, closed = exchange(d.port, pieces, None, eof)
        assert closed
        _no_router_5xx(got)
        seen[kind] = seen.get(kind, 0) + 1
        if kind == "then-garbage":  # a valid request then garbage: its answer, then the 400, then a close
            assert _answers(got) == [(200, None), (400, "invalid_http")], got
            return
        assert all(400 <= r.status < 500 for r in got), got
        want, _ = exchange(a.port, pieces, None, eof)
        assert _answers(got) == _answers(want), (pieces, got, want)

    good()
    bad()
    _quiet(routers)
    for c in (d, a):
        assert c.router is not None and c.router.poll() is None
        assert httpx.get(c.url + "/health", timeout=10).status_code == 200
        assert "Traceback" not in c.router_log(), c.router_log()[-3000:]
    fds1 = settled_fds(pid)
    assert fds1["other"] <= fds0["other"], (fds0, fds1)
    assert set(seen) >= {"200", "400", "404", "413", "415"}, seen  # the table reached each kind of answer
    counts = {p: d.metric("dplb_direct_relay_requests_total", {"path": p}) for p in ("direct", "continued", "declined")}
    # The relay parsed these itself: served them ("direct") or handed them on at a busy pool ("continued"; how many
    # depends on timing, more on a loaded box). Every request it was due to take (a worker answered it, so no edge
    # check refused it) is among them. The bounds are on counts of what was sent, not absolute: Hypothesis mixes the
    # literals of the imported local modules' sources into its inputs, and a compiled module has no source to read,
    # so the mix of inputs differs between the pure and the compiled build (and with any edit to those literals).
    taken = counts["direct"] + counts["continued"]
    assert taken >= due > 15 and counts["direct"] > 10 and counts["declined"] > 20, (counts, due, seen)
