"""One proxied request's state and its HTTP/1.1 header plumbing (the proxy's hot path; see :mod:`dplb.router.proxy`).

Contract
- :class:`Exchange` holds a request from the ASGI call to the end of its response: scope, receive, send, the
  request id, the start time, the status sent so far, whether the client went away and the worker connection in
  use (aborted when it does); once read, the route, body, peek and routing request; the decision; the request head
  for the workers; the response-id capture; and the request's trace hooks (:mod:`dplb.obs.tracing`). The router's
  server reports a disconnect through a hook (:mod:`dplb.runtime.serving`); under any other ASGI server
  :func:`watch_disconnect` waits for it on ``receive()``.
- :func:`request_head` writes the request line and headers for a worker: the client's end-to-end headers in
  their order, hop-by-hop ones (RFC 9110 §7.6.1 and those named in ``Connection``) and the router's own
  (host, content-length, x-request-id, expect, and ``Content-Encoding`` of a body the router decoded) replaced.
- :func:`response_headers` filters a worker's response head the same way, lowers the names' case and appends
  ``X-SG-Worker-ID`` and ``X-Request-Id``; :func:`response_lines` is the same rendered as the head's lines, in one
  pass (the direct relay's).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

from dplb.obs.tracing import NO_TRACE, NoTrace

if TYPE_CHECKING:
    from dplb.policy import RouteRequest
    from dplb.policy.decision import Decision
    from dplb.router.peek import Peek
    from dplb.router.routes import Route

from dplb.runtime.asgi import until_disconnect
from dplb.runtime.edge import DISCONNECT_EXT

HOP_BY_HOP: Final = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})
# Request headers the router sets itself; response headers the worker must not set for us.
REQ_OWN: Final = HOP_BY_HOP | {b"host", b"content-length", b"x-request-id", b"expect"}
RESP_OWN: Final = HOP_BY_HOP | {b"x-sg-worker-id", b"x-request-id", b"x-dplb-draining"}
# (Final: compiled, a C static instead of a module-dict and an attribute lookup per use.)
_perf_counter: Final = time.perf_counter
_NO_TRACE: Final = NO_TRACE


class Exchange:
    """One proxied request's state (one object instead of a dozen parameters; the model is uvicorn's
    ``RequestResponseCycle``). ``status``: the status sent to the client (0 = none yet); ``gone``: the client
    disconnected; ``conn``: the worker connection of the attempt in progress (aborted when the client goes);
    ``t_start``: ``time.perf_counter()`` seconds at the ASGI call; ``rid``: the request id (bytes).

    Set by the proxy as the request advances: ``route`` and ``pin`` (the matched route, None when none matches,
    and the response id in its path); ``body`` (the bytes forwarded), ``decoded`` (the router decoded its
    ``Content-Encoding``) and ``peek`` (its few parsed fields); ``request`` (the policy's view) and ``decision``
    (the last pick); ``fwd`` (the client's headers a worker gets, rendered by
    :func:`dplb.router.proxy.scan_headers` for :func:`request_head`; None: not rendered); ``head`` (the request head
    for the workers, with its blank line); ``capture`` (False, True:
    remember the id found in the answer, or the ``/v1/responses`` id itself); ``trace`` (tracing hooks); ``tenant``
    (the :class:`dplb.router.ticket.Ticket` of its tenant, None before it is known); ``resume`` (a
    :class:`dplb.router.resume.ResumeStream` when ``--resume-streams`` tracks it, else None)."""

    __slots__ = ("body", "capture", "conn", "decision", "decoded", "fwd", "gone", "head", "peek", "pin", "receive",
                 "request", "resume", "rid", "route", "scope", "send", "status", "t_start", "tenant", "trace")

    def __init__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.t_start = _perf_counter()
        self.rid = b""
        self.status = 0
        self.gone = False
        self.conn: Any = None
        self.route: Route | None = None
        self.pin: str | None = None
        self.trace: NoTrace = _NO_TRACE
        self.body = b""
        self.decoded = False
        self.head = b""
        self.fwd: bytes | None = None
        self.capture: Any = False
        self.resume: Any = None
        self.tenant: Any = None
        self.peek: Peek
        self.request: RouteRequest
        self.decision: Decision

    def cut(self) -> None:
        """End the response abnormally, the rest never coming (a worker broke off mid-body): the router's server
        closes the connection without the response's end (:meth:`dplb.runtime.edge.DisconnectHook.cut`); another
        ASGI server does that when the app returns with the response incomplete."""
        hook = self.scope.get("extensions", {}).get(DISCONNECT_EXT)
        if hook is not None:
            hook.cut()

    def client_gone(self) -> None:
        """The client disconnected: abort the worker connection (the engine aborts the request)."""
        self.gone = True
        if self.conn is not None:
            self.conn.abort()


async def watch_disconnect(ex: Exchange) -> None:
    """Completes when the client disconnects (after the body was read, receive() only reports that), calling
    :meth:`Exchange.client_gone`."""
    await until_disconnect(ex.receive)
    ex.client_gone()


def connection_tokens(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Extra hop-by-hop header names listed in ``Connection``."""
    toks: set[bytes] = set()
    for n, v in headers:
        if n.lower() == b"connection":
            toks.update(t.strip().lower() for t in v.split(b",") if t.strip())
    return frozenset(toks)


def request_head(scope: dict[str, Any], length: int, rid: bytes, decoded: bool, skip: frozenset[bytes],
                 end: bool, lines: bytes | None = None) -> bytes:
    """The request line and headers for the worker (``length``: body bytes; ``skip``: header names the router
    sets itself, lower case as ASGI gives them); with ``end``, the blank line too. ``lines``: the client's headers
    to forward rendered already (``name: value\r\n`` each, ``skip``'s and the names ``Connection`` lists left out:
    :func:`dplb.router.proxy.scan_headers`), used unless the router decoded the body (its ``Content-Encoding`` goes
    too)."""
    path = scope.get("raw_path") or scope["path"].encode()
    qs = scope.get("query_string") or b""
    if qs and b"?" not in path:
        path += b"?" + qs
    if lines is None or decoded:
        lines = _forwarded(scope["headers"], decoded, skip)
    return b"".join((scope["method"].encode(), b" ", path, b" HTTP/1.1\r\nhost: dplb-worker\r\ncontent-length: ",
                     str(length).encode(), b"\r\nx-request-id: ", rid, b"\r\n", lines, b"\r\n" if end else b""))


def _forwarded(hdrs: list[tuple[bytes, bytes]], decoded: bool, skip: frozenset[bytes]) -> bytes:
    """The lines of the client's headers a worker gets (:func:`request_head`): all but ``skip``, the names listed in
    ``Connection`` and, when the router ``decoded`` the body, ``Content-Encoding``."""
    for n, _ in hdrs:
        if n == b"connection":  # names listed in Connection are hop-by-hop too
            skip = skip | connection_tokens(hdrs)
            break
    if decoded:
        skip = skip | {b"content-encoding"}
    parts: list[bytes] = []
    for n, v in hdrs:
        if n not in skip:
            parts += (n, b": ", v, b"\r\n")
    return b"".join(parts)


def response_headers(up_headers: list[tuple[bytes, bytes]], worker_id: bytes,
                     rid: bytes) -> tuple[list[tuple[bytes, bytes]], bool, bool]:
    """(headers for the client, is SSE, the worker's draining marker present) of a worker's response head; the
    names in lower case (as uvicorn writes them)."""
    out = []
    is_sse = draining = listed = False
    for n, v in up_headers:
        n = n.lower()
        if n in RESP_OWN:  # the usual one is the x-request-id the worker echoes
            if n == b"x-dplb-draining":
                draining = True
            elif n == b"connection":
                listed = True
        elif n == b"content-type" and v.startswith(b"text/event-stream"):
            is_sse = True
            out.append((n, v))
        else:
            out.append((n, v))
    if listed:
        extra = connection_tokens(up_headers)
        out = [(n, v) for n, v in out if n not in extra]
    out.append((b"x-sg-worker-id", worker_id))
    out.append((b"x-request-id", rid))
    return out, is_sse, draining


def response_lines(up_headers: list[tuple[bytes, bytes]], worker_id: bytes,
                   rid: bytes) -> tuple[bytes, bool, bool, bool] | None:
    """:func:`response_headers` rendered as the lines of the client's response head (``name: value\r\n`` each,
    the same headers in the same order), in one pass: (lines, a Content-Length among them, is SSE, the worker's
    draining marker present). None when the worker's head has a ``Connection`` header (the names it lists are
    dropped too: :func:`response_headers` then). The names a worker sends (in lower case) are compared first; any
    other is lowered and filtered as :func:`response_headers` filters it."""
    parts: list[bytes] = []
    sized = is_sse = draining = False
    for n, v in up_headers:
        if n == b"date" or n == b"server":  # (uvicorn's usual head first: no lower(), no set lookup)
            pass
        elif n == b"content-length":
            sized = True
        elif n == b"content-type":
            if v.startswith(b"text/event-stream"):
                is_sse = True
        elif n == b"x-request-id":
            continue
        else:
            n = n.lower()
            if n in RESP_OWN:
                if n == b"x-dplb-draining":
                    draining = True
                elif n == b"connection":
                    return None
                continue
            if n == b"content-length":
                sized = True
            elif n == b"content-type" and v.startswith(b"text/event-stream"):
                is_sse = True
        parts.append(n)  # (appends: cheaper than one += of a tuple, compiled and in CPython 3.11 alike)
        parts.append(b": ")
        parts.append(v)
        parts.append(b"\r\n")
    parts += (b"x-sg-worker-id: ", worker_id, b"\r\nx-request-id: ", rid, b"\r\n")
    return b"".join(parts), sized, is_sse, draining


__all__ = ["HOP_BY_HOP", "REQ_OWN", "RESP_OWN", "Exchange", "connection_tokens", "request_head",
           "response_headers", "response_lines", "watch_disconnect"]
