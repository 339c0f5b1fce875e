"""Request intake of the proxy, before routing: content checks, ``Content-Encoding`` decoding and the peek at the
few fields the router reads (:class:`dplb.router.peek.Peek`; which workers may take the request:
:meth:`dplb.router.proxy.Proxy.take_body`).

Contract
- Every refusal is a :class:`Rejected` carrying the :class:`~dplb.errors.RouterErrorKind` and message to answer.
- :func:`check_head` (before the body is read): 413 for a declared length over the limit, 415 for a Content-Type
  the route does not take (a JSON route takes none or an empty one as JSON, as FastAPI does) or an unknown
  ``Content-Encoding``. :func:`read_body` (after): decodes gzip/deflate
  bounded by ``limit`` decoded bytes (413, never more than ``limit + 1`` bytes are inflated), peeks JSON (400
  ``invalid_json``/``body_not_object``) or the multipart ``model`` field (:attr:`Peek.model` either way); a
  client that disconnects before its body is complete is 499 ``client_closed_request`` (:func:`receive_body`;
  nothing is sent). The body is never re-serialised: the worker gets the bytes, decoded only when they were compressed.
- :func:`form_models`: every ``model`` field of a whole multipart body, strictly (what the tenant gate checks
  against an allow-list: a form the router might read otherwise than vLLM does is refused there).
- A header the router reads that must have one value (``Content-Type``, ``Authorization``) sent twice is 400
  ``duplicate_header`` (:func:`duplicate_header_message`; found by :func:`dplb.router.proxy.scan_headers` and
  :func:`authorizations`): the router would read one and the worker, or a proxy before it, maybe the other.
- :func:`bearer_ok`: the one API-key check (``Authorization: Bearer <key>``, constant time) of the proxy and the
  local endpoints.
"""

from __future__ import annotations

import hmac
import re
import zlib
from typing import Any

import msgspec

from dplb.errors import BodyTooLarge, RouterErrorKind
from dplb.router.peek import NO_PEEK, Peek, peek_decoder
from dplb.router.routes import Route
from dplb.runtime.asgi import receive_body as asgi_receive_body


def is_json_type(mtype: bytes) -> bool:
    """True for the media type (lower case, no parameters) of a JSON body: ``application/json`` or a structured
    syntax ``application/*+json`` type (RFC 6839 §3.1, e.g. ``application/vnd.api+json``), as FastAPI (vLLM) takes."""
    return mtype == b"application/json" or (mtype.startswith(b"application/") and mtype.endswith(b"+json"))


#: A JSON string escape (``\\`` consumed whole, so ``\\ud800`` is no ``\u`` escape); group 1: a ``\u`` escape's hex.
_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)", re.S)


def lone_surrogate(body: bytes) -> str | None:
    """The first ``\\uXXXX`` escape of ``body`` that is half a UTF-16 surrogate pair (a high one not followed at once
    by a low one, or a low one alone), as written; None when there is none. msgspec refuses such a string with words
    about truncation or hex escapes; this names the cause (read on the error path only)."""
    high: re.Match[bytes] | None = None
    for m in _ESCAPE.finditer(body):
        cp = int(m[1], 16) if m[1] else -1
        if high is not None:
            if m.start() == high.end() and 0xDC00 <= cp <= 0xDFFF:
                high = None
                continue
            break
        if 0xD800 <= cp <= 0xDBFF:
            high = m
        elif 0xDC00 <= cp <= 0xDFFF:
            return m[0].decode()
    return high[0].decode() if high is not None else None


class Rejected(Exception):
    """The request is refused before it is routed; ``kind`` is the router error to answer with ``str(self)``."""

    def __init__(self, kind: RouterErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


_WBITS = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}


def decode_body(body: bytes, encoding: bytes, limit: int, check_only: bool = False) -> bytes:
    """Undo ``Content-Encoding`` ``encoding`` (``gzip``, ``deflate`` — zlib or raw —, ``identity``, or a comma list
    applied in order) with at most ``limit`` decoded bytes. Raises :class:`Rejected`: 415
    ``unsupported_content_encoding`` for another coding, 413 ``body_too_large`` past ``limit`` (a zip bomb stops
    there: decompression never produces more than ``limit + 1`` bytes), 400 ``invalid_content_encoding`` for
    corrupt or truncated data. ``check_only``: only refuse unknown codings."""
    codings = [c.strip().lower() for c in encoding.split(b",") if c.strip()]
    for c in codings:
        if c != b"identity" and c not in _WBITS:
            raise Rejected(RouterErrorKind.UNSUPPORTED_ENCODING, f"Content-Encoding {c.decode('latin-1')!r} is not "
                           "supported; send gzip, deflate or identity")
    if check_only:
        return body
    for c in reversed(codings):
        if c == b"identity":
            continue
        body = _inflate(body, _WBITS[c], limit, c == b"deflate")
    return body


def _inflate(data: bytes, wbits: int, limit: int, raw_fallback: bool) -> bytes:
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as e:
        if raw_fallback:  # some clients send raw DEFLATE as "deflate"
            return _inflate(data, -zlib.MAX_WBITS, limit, False)
        raise Rejected(RouterErrorKind.BAD_ENCODING, f"request body is not valid compressed data: {e}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise Rejected(RouterErrorKind.BODY_TOO_LARGE, f"decoded request body is over the {limit}-byte limit")
    if not d.eof:
        raise Rejected(RouterErrorKind.BAD_ENCODING, "compressed request body is truncated")
    return out


_NAME_MODEL = b'name="model"'


def multipart_model(body: bytes) -> str | None:
    """The ``model`` field of a ``multipart/form-data`` body (searched in its first 64 KiB; linear, no regex
    backtracking on hostile input), or None."""
    head = body[:65536]
    low = head.lower()
    i = low.find(_NAME_MODEL)
    while i != -1:
        line = low.rfind(b"\n", 0, i) + 1
        if low.startswith(b"content-disposition:", line):
            start = head.find(b"\r\n\r\n", i) + 4
            end = head.find(b"\r\n", start) if start >= 4 else -1
            return head[start:end].decode("utf-8", "replace") if 0 < end - start <= 256 else None
        i = low.find(_NAME_MODEL, i + 1)
    return None


_DISPOSITION = b"content-disposition:"


def form_models(body: bytes) -> list[str | None]:
    """The value of every ``model`` field of a ``multipart/form-data`` body, in order, searched in the whole body:
    each ``Content-Disposition`` line whose parameters mention ``model`` in any spelling. An entry is None when the
    router cannot be sure vLLM (Starlette's form parser) reads the same field: a name other than exactly
    ``name="model"`` that still says model (``name=model``, ``name="MODEL"``, ``name*=…``), a file part
    (``filename``), or a value that is not one line of 1–256 bytes followed by the next boundary. Checked against
    Starlette's ``MultiPartParser`` on such forms: where this reads a value it is the one Starlette reads.
    Linear in the body."""
    out: list[str | None] = []
    low = body.lower()
    i = low.find(_DISPOSITION)
    while i != -1:
        end = low.find(b"\r\n", i)
        line = body[i + len(_DISPOSITION): end if end != -1 else len(body)]
        at_start = i == 0 or low[i - 1:i] == b"\n"
        if at_start and b"model" in line.lower():
            params = [p.strip() for p in line.split(b";")[1:]]
            exact = b'name="model"' in params and not any(p.lower().startswith(b"filename") for p in params)
            value = None
            if exact and end != -1:
                start = body.find(b"\r\n\r\n", end - 2)
                stop = body.find(b"\r\n", start + 4) if start != -1 else -1
                if start != -1 and 0 < stop - start - 4 <= 256 and body.startswith(b"\r\n--", stop):
                    value = body[start + 4:stop].decode("utf-8", "replace")
            out.append(value)
        i = low.find(_DISPOSITION, i + 1)
    return out


def check_head(route: Route, clen: int, ctype: bytes, encoding: bytes, limit: int) -> None:
    """Refuse what can be refused from the headers alone (module docstring): ``clen`` the declared
    ``Content-Length`` (negative: none or malformed), ``limit`` the body limit in bytes. Raises :class:`Rejected`."""
    if clen > limit:
        raise Rejected(RouterErrorKind.BODY_TOO_LARGE, f"request body of {clen} bytes is over the {limit}-byte limit")
    # (the usual value is its own media type: no split, strip or lower)
    mtype = ctype if ctype == b"application/json" else ctype.split(b";", 1)[0].strip().lower()
    if route.body == "json" and ctype and not is_json_type(mtype):
        raise Rejected(RouterErrorKind.UNSUPPORTED_MEDIA, "Content-Type must be application/json (or an "
                       "application/*+json type)")
    if route.body == "multipart" and mtype != b"multipart/form-data":
        raise Rejected(RouterErrorKind.UNSUPPORTED_MEDIA, "Content-Type must be multipart/form-data")
    if encoding:
        decode_body(b"", encoding, -1, check_only=True)


def read_body(route: Route, body: bytes, encoding: bytes, limit: int) -> tuple[bytes, Peek, Any, bool]:
    """(body to forward, peek, model or None, decoded?) of a request body. Raises :class:`Rejected`."""
    decoded = False
    if encoding and encoding.strip().lower() != b"identity":
        body = decode_body(body, encoding, limit)
        decoded = True
    if route.body == "json":
        try:
            peek = peek_decoder.decode(body)
        except msgspec.ValidationError:
            raise Rejected(RouterErrorKind.NOT_AN_OBJECT, "request body must be a JSON object") from None
        except msgspec.DecodeError as e:
            half = lone_surrogate(body)
            why = (f"invalid \\u escape: lone surrogate {half} (a surrogate escape must be half of a pair, "
                   "\\uD800-\\uDBFF then \\uDC00-\\uDFFF)") if half else str(e)
            raise Rejected(RouterErrorKind.INVALID_JSON, f"request body is not valid JSON: {why}") from None
        except RecursionError:  # nested deeper than the interpreter's recursion limit (~1000 levels)
            raise Rejected(RouterErrorKind.INVALID_JSON, "request body is not valid JSON: nested too deeply") \
                from None
        return body, peek, peek.model, decoded
    if route.body == "multipart":
        model = multipart_model(body)
        return body, Peek(model=model), model, decoded
    return body, NO_PEEK, None, decoded


async def receive_body(receive: Any, limit: int, hook: Any = None) -> bytes | None:
    """The whole request body from the ASGI ``receive`` (:func:`dplb.runtime.asgi.receive_body`), or None as soon as
    it exceeds ``limit`` bytes. Raises :class:`Rejected` ``client_closed_request`` (499) when the client disconnects
    before the body is complete: a client close, not bad input; ``request_timeout`` (408) instead when the request's
    disconnect ``hook`` (:class:`dplb.runtime.edge.DisconnectHook`) says the edge closed it for a body too slow (the
    edge sent the 408)."""
    try:
        body = await asgi_receive_body(receive, limit)
    except BodyTooLarge:
        return None
    if body is None:
        if hook is not None and hook.timed_out:
            raise Rejected(RouterErrorKind.REQUEST_TIMEOUT, "the request body stopped coming")
        raise Rejected(RouterErrorKind.CLIENT_CLOSED, "the client closed the connection during the request body")
    return body


def duplicate_header_message(name: bytes) -> str:
    """The message of a 400 ``duplicate_header`` for header ``name`` (lower case, as ASGI gives it)."""
    return (f"the {name.decode('latin-1').title()} header was sent more than once; send it once (RFC 9110 allows "
            "one value)")


def authorizations(headers: list[tuple[bytes, bytes]]) -> tuple[bytes, int]:
    """(the ``Authorization`` value, how many times the header came) of an ASGI header list (b"" when none)."""
    value, n = b"", 0
    for name, v in headers:
        if name == b"authorization":
            value, n = v, n + 1
    return value, n


def bearer_credential(api_key: str | None) -> bytes | None:
    """The ``Authorization`` value that :func:`bearer_ok` accepts for ``api_key`` (scheme lower case), or None when
    no key is set (nothing to check)."""
    return b"bearer " + api_key.encode() if api_key else None


def bearer_ok(authorization: bytes, credential: bytes) -> bool:
    """True when the ``Authorization`` header value is ``Bearer <key>`` for ``credential``
    (:func:`bearer_credential`): the scheme case-insensitive, the key compared in constant time."""
    return hmac.compare_digest(authorization[:7].lower() + authorization[7:], credential)


__all__ = ["Rejected", "authorizations", "bearer_credential", "bearer_ok", "check_head", "decode_body",
           "duplicate_header_message",
           "form_models", "multipart_model", "read_body", "receive_body"]
