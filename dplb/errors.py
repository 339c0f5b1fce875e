"""Every error DPLB raises on purpose, in one place.

Contract: each class says what went wrong *and what to do about it* in its message, so an operator reading a log
line or a CLI error can act without reading source. CLI entry points catch :class:`DPLBError` and print the
message without a traceback (exit code 2 for configuration problems, 1 otherwise).

The router's own HTTP errors (OpenAI-shaped JSON bodies with bounded reason codes) are described by
:class:`RouterErrorKind`. Every OpenAI-shaped error body DPLB sends — the router's, the HTTP edge's, the worker's
draining refusal, the sim engine's — is built by :func:`openai_error_body` (docs/DESIGN.md §6). A worker's own
in-band failure of a stream it had started (vLLM's ``data: {"error": {…, "code": 500}}`` event, then ``[DONE]``) is
recognised by :func:`event_failure` and :func:`stream_failure`.
"""

from __future__ import annotations

import enum
import errno
import os
import re
import socket
from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.decode
_EVENT_END = re.compile(rb"\r?\n\r?\n")


class DPLBError(Exception):
    """Base class of every deliberate DPLB error. ``str(err)`` is a complete, actionable message."""

    exit_code = 1


class ConfigError(DPLBError, ValueError):
    """A configuration value was refused at start-up (weights not summing to 1, negative sizes, …)."""

    exit_code = 2


#: Where Linux takes the local port of an outgoing connection from (ip(7), ``ip_local_port_range``).
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """This machine's ephemeral port range (low, high), inclusive; None when it cannot be read."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    return low, high


def port_holders_hint(port: int) -> str:
    """How to see what holds local TCP ``port``: ``ss -tanp 'sport = :PORT'`` lists a listener and also the
    connections and TIME-WAIT sockets on that local port, which ``ss -ltnp`` (listeners only) does not show and which
    block a bind all the same; plus, for a port inside the ephemeral range (:func:`ephemeral_range`), that outgoing
    connections take their local ports there (such a port is taken by chance: one below the range is the fix)."""
    hint = f"`ss -tanp 'sport = :{port}'` shows it (a listener, or a connection or TIME-WAIT on that local port)"
    rng = ephemeral_range()
    if rng is not None and rng[0] <= port <= rng[1]:
        hint += (f"; {port} is in the ephemeral port range {rng[0]}-{rng[1]} ({EPHEMERAL_RANGE_FILE}), where outgoing "
                 f"connections take their local ports: a port below {rng[0]} is not taken by chance")
    return hint


class PortInUseError(ConfigError):
    """A TCP address the stack must bind is taken: names the address, the flag to change and how to see what holds
    it (:func:`port_holders_hint`). The message is ``what: reason; fix``."""

    def __init__(self, host: str, port: int, reason: str, flag: str = "--port", who: str = "") -> None:
        what = f" for {who}" if who else ""
        super().__init__(f"cannot bind {host}:{port}{what}: {reason}; stop what holds it or pass another {flag}. "
                         f"{port_holders_hint(port)}")


def bind_error(host: str, port: int, err: OSError, flag: str = "--port", who: str = "",
               host_flag: str = "--host") -> ConfigError:
    """The error to raise when binding ``host:port`` failed with ``err``. :class:`PortInUseError` only when the
    port is taken (``EADDRINUSE``); a host that does not resolve (``socket.gaierror``) or is not an address of this
    machine (``EADDRNOTAVAIL``) names ``host_flag``; anything else (``EACCES`` for a port below 1024, …) names
    ``flag``. No other process is blamed unless one holds the port. Every message is ``what: reason; fix`` (one
    ``; `` before the fix: ``dplb doctor`` splits it there)."""
    reason = err.strerror or str(err)
    what = f"cannot bind {host}:{port}" + (f" for {who}" if who else "")
    if isinstance(err, socket.gaierror) or err.errno == errno.EADDRNOTAVAIL:
        return ConfigError(f"{what}: {reason}; {host_flag} must be an address of this machine (e.g. 0.0.0.0, "
                           "127.0.0.1)")
    if err.errno == errno.EADDRINUSE:
        return PortInUseError(host, port, reason, flag, who)
    return ConfigError(f"{what}: {reason}; pass another {flag}")


class NativeBuildError(DPLBError):
    """The compiled build (``scripts/build_native.sh``) in the package may not run: partial, or stale and not
    accepted. The message is :meth:`dplb.native.Build.refusal`'s line: what is wrong and the two fixes."""


class StaleBuildError(NativeBuildError):
    """The compiled build is whole but stale (a source changed since it was built) and not accepted. Its own exit
    status (75, ``EX_TEMPFAIL`` of sysexits.h: the same command succeeds once the tree is rebuilt or cleaned) tells
    ``dplb launch`` that a router restart was refused for this reason: it keeps the workers and retries."""

    exit_code = 75


class PluginError(DPLBError):
    """A policy plugin broke the framework's contract at run time (a scorer's ``score`` returned something that is
    not one number per candidate, a picker's ``pick`` not a ``(candidate, reason)`` pair): names the plugin, what it
    returned and what it must return. The pick fails as it does when the plugin raises."""


class ShmError(DPLBError):
    """Base class of shared-memory segment errors; ``path`` is the segment file involved."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class ShmMissingError(ShmError):
    """The segment file does not exist (never created, or removed by a cleanup / a reboot)."""

    def __init__(self, path: str | None) -> None:
        where = f"'{path}'" if path else "(no path given)"
        super().__init__(
            f"DPLB shared-memory segment {where} does not exist. Set DPLB_SHM_PATH (or pass --shm-path) to the "
            "segment that `dplb launch` created (ls /dev/shm | grep dplb_state_), or start the stack with "
            "`dplb launch`, which creates it. `dplb doctor` lists segments and finds stale ones.",
            path,
        )


class ShmLayoutError(ShmError):
    """The file exists but is not a DPLB segment of this layout (wrong magic, version or size).

    Removal is advised only for a file that carries DPLB's magic directly under ``/dev/shm`` (``dplb_magic``):
    anything else may be the user's file and is never suggested for ``rm``."""

    def __init__(self, path: str, detail: str, *, dplb_magic: bool = True) -> None:
        if dplb_magic and os.path.dirname(os.path.abspath(path)) == "/dev/shm":
            advice = ("It was probably written by another DPLB version. Stop the DPLB processes that use it, then "
                      f"let `dplb launch` (or `dplb segment create`) replace it, or remove it (rm '{path}').")
        else:
            advice = ("It is not a DPLB state segment, and DPLB will not touch it: set DPLB_SHM_PATH (or pass "
                      "--shm-path) to the segment `dplb launch` created (ls /dev/shm | grep dplb_state_).")
        super().__init__(f"'{path}' is not a usable DPLB state segment: {detail}. {advice}", path)


class ShmPathError(ShmError):
    """A segment path DPLB refuses to use: a directory, a file that is not a DPLB segment, or a segment that a live
    stack uses. Nothing was written or removed."""

    exit_code = 2


class ShmCreateError(ShmPathError):
    """A segment file cannot be created: its directory is missing, is not a directory, or is not writable."""

    def __init__(self, path: str, err: OSError) -> None:
        d = os.path.dirname(os.path.abspath(path))
        why = {errno.ENOENT: "does not exist", errno.ENOTDIR: "is not a directory"}.get(
            err.errno or 0, f"cannot be written ({err.strerror})")
        super().__init__(f"cannot create segment '{path}': its directory {d} {why}; pass a --shm-path in an "
                         "existing, writable directory (normally /dev/shm/dplb_state_<name>)", path)


class ShmSpaceError(ShmError):
    """``/dev/shm`` (or the directory of the segment) has no room for the segment."""

    def __init__(self, path: str, needed: int, detail: str) -> None:
        super().__init__(
            f"cannot allocate {needed} bytes for the DPLB state segment '{path}': {detail}. /dev/shm is full or "
            "too small: free it (remove stale dplb_state_* segments; `dplb doctor` finds them) or enlarge it; in "
            "Docker, start the container with --shm-size=1g (Docker's default is 64 MB).",
            path,
        )


class ShmWorkerIdError(ShmError):
    """A worker id outside ``[0, num_workers)`` of the segment."""


class RouterErrorKind(enum.Enum):
    """Errors the router itself answers with: (HTTP status, OpenAI error type, bounded reason code[, the body's
    code where OpenAI's is coarser than the reason]).

    The reason code is the ``code`` field of the JSON body and the ``reason`` label of
    ``dplb_requests_rejected_total``; the set is closed so metric cardinality stays bounded.

    The router answers 503 only for a request that reached no engine, so nothing was generated: no worker could
    take it or be connected to (``worker_unreachable``: the connection failed before a byte was sent), or it
    waited in the tenants' fair queue and was never sent (the workers' own 503s are refusals before any work too:
    DPLB's ``worker_draining``, vLLM's "the model is currently scaling"). A front balancer may re-send
    a 503 to another host (docs/DESIGN.md §13; the configs ``dplb fleet`` writes do). A request that reached an
    engine and failed there is never answered 503: ``worker_stalled`` and ``worker_timeout`` 504, ``worker_failed``
    502 (the engine may have started it, and a request that hangs or crashes an engine would take the next host
    down too).
    """

    NO_WORKERS = (503, "service_unavailable", "no_workers_registered")
    NONE_ROUTABLE = (503, "service_unavailable", "no_routable_worker")
    ALL_OVER_CAP = (503, "service_unavailable", "all_workers_over_queue_cap")
    INVALID_JSON = (400, "invalid_request_error", "invalid_json")
    NOT_AN_OBJECT = (400, "invalid_request_error", "body_not_object")
    BODY_TOO_LARGE = (413, "invalid_request_error", "body_too_large")
    HEADERS_TOO_LARGE = (431, "invalid_request_error", "headers_too_large")
    INVALID_HTTP = (400, "invalid_request_error", "invalid_http")
    METHOD_NOT_ALLOWED = (405, "invalid_request_error", "method_not_allowed")
    UNSUPPORTED_MEDIA = (415, "invalid_request_error", "unsupported_media_type")
    UNSUPPORTED_ENCODING = (415, "invalid_request_error", "unsupported_content_encoding")
    BAD_ENCODING = (400, "invalid_request_error", "invalid_content_encoding")
    # A one-value header the router reads (Content-Type, Authorization) sent twice: which one counts is ambiguous.
    DUPLICATE_HEADER = (400, "invalid_request_error", "duplicate_header")
    MODEL_NOT_FOUND = (404, "invalid_request_error", "model_not_found")
    # The client closed the connection before its request body was complete: nobody is left to answer, so nothing
    # is sent; 499 (nginx's "client closed request") is the status the metrics record.
    CLIENT_CLOSED = (499, "invalid_request_error", "client_closed_request")
    # The client's request head or body came too slowly (--header-timeout, --body-timeout): answered by the HTTP edge
    # (dplb.runtime.protocol), which then closes the connection.
    REQUEST_TIMEOUT = (408, "invalid_request_error", "request_timeout")
    # A CORS preflight from an origin outside --cors-allowed-origins.
    CORS_ORIGIN = (400, "invalid_request_error", "cors_origin_not_allowed")
    ROUTE_DISABLED = (404, "invalid_request_error", "route_disabled")  # needs a router flag (named in the message)
    UNAUTHORIZED = (401, "authentication_error", "invalid_api_key")
    # Tenants (docs/DESIGN.md §15): a model outside the tenant's allow-list; its limits; the router's fair queue.
    MODEL_NOT_ALLOWED = (403, "permission_error", "model_not_allowed")
    # A route only an operator's key may use with tenants (LoRA administration, a keyed /metrics).
    ADMIN_ONLY = (403, "permission_error", "admin_only")
    # A stored response (/v1/responses/{id}, previous_response_id) this tenant did not create, or one the router
    # cannot tell the creator of: vLLM's own 404 words, no oracle of another tenant's ids.
    RESPONSE_NOT_FOUND = (404, "invalid_request_error", "response_not_found")
    # A POST /v1/responses whose request_id is the id of another tenant's stored response (vLLM would replace it).
    RESPONSE_ID_IN_USE = (409, "invalid_request_error", "response_id_in_use")
    RATE_LIMITED = (429, "requests", "rate_limit_exceeded")
    # The body's code is OpenAI's for a tokens-per-minute 429 (type "tokens", code "rate_limit_exceeded"); the
    # reason label keeps DPLB's own, so the two limits stay apart in dplb_requests_rejected_total.
    TOKENS_RATE_LIMITED = (429, "tokens", "tokens_rate_limit_exceeded", "rate_limit_exceeded")
    # One request's reserved tokens (prompt estimate + max_tokens) exceed the tenant's whole tokens_per_min: no
    # wait makes it fit, so it is a client error, not a 429 (clients retry those).
    TOKENS_EXCEED_QUOTA = (400, "invalid_request_error", "tokens_exceed_quota")
    CONCURRENCY_LIMITED = (429, "requests", "concurrency_limit_exceeded")
    QUEUE_SHARE_EXCEEDED = (429, "requests", "queue_share_exceeded")
    QUEUE_FULL = (503, "service_unavailable", "queue_full")
    QUEUE_TIMEOUT = (503, "service_unavailable", "queue_timeout")
    DRAINING_QUEUED = (503, "service_unavailable", "router_draining")
    # No worker could be connected to (the connection failed: no request byte was sent, so no engine saw it).
    UPSTREAM_UNREACHABLE = (503, "service_unavailable", "worker_unreachable")
    UPSTREAM_TIMEOUT = (504, "upstream_error", "worker_timeout")
    UPSTREAM_FAILED = (502, "upstream_error", "worker_failed")
    # The worker's engine stopped making progress (docs/DESIGN.md §6): the gateway's 504 (its upstream made no
    # progress in time; it may have started the request, so no 503: see the class docstring), with Retry-After.
    WORKER_STALLED = (504, "upstream_error", "worker_stalled")
    INTERNAL = (500, "server_error", "internal_error")  # a router bug: logged with its traceback, never sent

    @property
    def status(self) -> int:
        """HTTP status code."""
        return self.value[0]

    @property
    def type(self) -> str:
        """OpenAI ``error.type``."""
        return self.value[1]

    @property
    def code(self) -> str:
        """Bounded reason code: the ``reason`` metric label, and ``error.code`` unless :attr:`body_code` differs."""
        return self.value[2]

    @property
    def body_code(self) -> str:
        """``error.code`` of the body: :attr:`code`, or OpenAI's code where DPLB's reason is finer (a 4th field)."""
        return self.value[3] if len(self.value) > 3 else self.value[2]


#: The challenge every 401 of the router carries (RFC 9110 §11.6.1 requires one; RFC 6750 §3 names the scheme).
WWW_AUTHENTICATE = (b"www-authenticate", b"Bearer")


class BodyTooLarge(DPLBError):
    """A request body grew past its byte limit while being received (``limit``: the limit, bytes)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is over the {limit}-byte limit")
        self.limit = limit


class UpstreamError(Exception):
    """Base class of the router's transport errors talking to a worker (:mod:`dplb.router.upstream`)."""


class ConnectFailed(UpstreamError):
    """The worker could not be reached; no request byte was sent."""


class UpstreamTimeout(UpstreamError):
    """A per-phase timeout expired (``phase`` = "first_byte" or "idle")."""

    def __init__(self, phase: str, seconds: float) -> None:
        super().__init__(f"worker sent nothing for {seconds:g} s ({phase})")
        self.phase = phase


class UpstreamClosed(UpstreamError):
    """The worker closed the connection before the response was complete."""


#: How a worker connection ended with the request undelivered (the ``reason`` label of
#: ``dplb_upstream_resends_total``): ``reset`` (ECONNRESET: the worker closed it with our request unread in its socket,
#: as an idle keep-alive close that crossed the request does, or a process that died), ``epipe`` (EPIPE: our write
#: found it closed already). A clean EOF is not one: on a Unix socket a peer that closes with bytes unread resets
#: (Linux's ``unix_release_sock``), so an EOF after our write means the worker read the request — it may be in
#: the engine.
RESEND_REASONS = ("reset", "epipe")


class UndeliveredRequest(UpstreamClosed):
    """The worker connection ended before one response byte came back, with the request undelivered (``reason``:
    one of :data:`RESEND_REASONS`): it reached no engine and may be sent again (on a connection reused from the
    pool, what an HTTP client does, Go's net/http and urllib3 alike; Envoy's ``reset`` retry-on)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the connection to the worker ended with the request undelivered ({reason})")
        self.reason = reason


def openai_error_body(message: str, type_: str, code: str | int) -> bytes:
    """The OpenAI error body ``{"error": {"message", "type", "param": null, "code"}}`` as compact UTF-8 JSON
    (msgspec): OpenAI's error object (message, type, param, code; DPLB's errors name no request parameter) and
    vLLM's, so a router's, an edge's, a worker's and the sim engine's errors have one shape."""
    return _encode({"error": {"message": message, "type": type_, "param": None, "code": code}})


def error_body(kind: RouterErrorKind, message: str) -> bytes:
    """The OpenAI error body of one of the router's own errors: ``kind``'s type and body code, ``message``."""
    return openai_error_body(message, kind.type, kind.body_code)


def event_failure(event: Any) -> str | None:
    """The message of a decoded SSE event that is an engine's in-band failure of the stream — an OpenAI-shaped error
    object with a numeric ``code`` of 500 or more and no ``choices`` (vLLM's ``create_streaming_error_response``:
    an engine that died under a live API server, ``EngineDeadError``; a generation that finished with an error) —
    else None. A 4xx error event (a request the engine refused mid-stream) is not one."""
    if not isinstance(event, dict) or "choices" in event:
        return None
    err = event.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    if isinstance(code, int) and not isinstance(code, bool) and code >= 500:
        return str(err.get("message"))  # type: ignore[union-attr]
    return None


def stream_failure(tail: bytes) -> str | None:
    """The message of the first in-band failure event (:func:`event_failure`) among the whole SSE events of
    ``tail`` — the last bytes of a stream, e.g. its last two chunks: vLLM sends the error event and then
    ``data: [DONE]`` as two chunks of a response that otherwise ends cleanly — or None. Cheap when there is none:
    one substring search before anything is parsed."""
    if b'"error"' not in tail:
        return None
    start = 0
    for m in _EVENT_END.finditer(tail):
        ev, start = tail[start:m.start()], m.end()
        if not ev.startswith(b"data:"):
            continue
        try:
            msg = event_failure(_decode(ev[5:]))
        except msgspec.DecodeError:
            continue
        if msg is not None:
            return msg
    return None


def worker_stalled_message(worker: int, stall_after_s: float, others: int) -> str:
    """The message of a :attr:`RouterErrorKind.WORKER_STALLED` error (the 504 and the SSE error event) on
    ``worker``: what happened and the advice, worded by ``others``, how many other workers are routable now — a
    retry goes to one of them (≥ 1), or waits for this one or a restart (0: a one-worker stack has no other)."""
    advice = "retry (another worker will take it)" if others > 0 else \
        "no other worker is routable now; retry later"
    return (f"worker {worker} stalled: its engine made no progress for {stall_after_s:g} s with requests in flight; "
            f"{advice}")
