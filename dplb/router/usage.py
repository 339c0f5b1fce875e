"""Token counts of one proxied response, read from the bytes the router relays (docs/DESIGN.md §15).

Contract
- :class:`Meter` sees every body chunk of the worker's response (:meth:`Meter.chunk`) and, at the end,
  :meth:`Meter.finish` returns the engine's ``usage`` (prompt, completion, cached tokens) when the response
  carried one: the ``usage`` object of a JSON body, or of the SSE event that has one (the final usage chunk of a
  stream with ``stream_options.include_usage``). Nothing is changed in what is relayed.
- While a stream runs, :attr:`Meter.new` is how many generated-token events the last chunk completed (``data:``
  events other than the usage-only one and ``[DONE]``): the fair queue charges them as they are produced and
  corrects by the engine's count at the end.
- A stream whose client did not ask for usage: the router asks for it (``stream_options.include_usage``, written
  into the body only when the body has no ``stream_options``) and, with ``strip``, relays the stream without the
  usage-only event, so the client receives the events it would have received; to find whole events the relay
  then forwards complete events only (a stream that breaks off mid-event loses that fragment, which would
  otherwise corrupt the router's closing error event). Without any usage (another route, a broken stream)
  :attr:`Meter.exact` is False and the ledger counts the generated events as completion tokens.
- :func:`with_fields` writes fields first into a JSON body (the rest of its bytes unchanged); :func:`max_tokens`
  reads a body's output-token limit (:func:`output_limit` from the fields the router's body peek already decoded);
  :func:`sequences`: how many sequences it generates (``n`` / ``best_of``), each up to that limit.
- Bounded: a JSON body is kept up to :data:`MAX_JSON` bytes for its usage; SSE keeps only the unfinished event.
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_JSON = 4 * 1024 * 1024
_USAGE = b'"usage":{'
_USAGE_SP = b'"usage": {'


class _Details(msgspec.Struct):
    cached_tokens: int | None = 0


class Usage(msgspec.Struct):
    """The OpenAI ``usage`` object's counts (tokens). The Responses API's names (``input_tokens``,
    ``output_tokens``, ``input_tokens_details``) are read into the chat names when those are absent."""

    prompt_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: _Details | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    input_tokens_details: _Details | None = None

    def __post_init__(self) -> None:
        if not self.prompt_tokens and self.input_tokens:
            self.prompt_tokens = self.input_tokens
        if not self.completion_tokens and self.output_tokens:
            self.completion_tokens = self.output_tokens
        if self.prompt_tokens_details is None:
            self.prompt_tokens_details = self.input_tokens_details

    @property
    def cached(self) -> int:
        """Prompt tokens served from the prefix cache (0 when the engine did not say)."""
        d = self.prompt_tokens_details
        return (d.cached_tokens or 0) if d is not None else 0


class _Body(msgspec.Struct):
    usage: Usage | None = None


_decode_body = msgspec.json.Decoder(_Body).decode


def _has_usage(data: bytes) -> bool:
    return _USAGE in data or _USAGE_SP in data


class Meter:
    """Token accounting of one response (module docstring). ``sse``: the response is an event stream; ``strip``:
    the router asked for the usage chunk itself (the client did not), so it is taken out of what is relayed."""

    __slots__ = ("_buf", "events", "exact", "new", "sse", "strip", "usage")

    def __init__(self, sse: bool, strip: bool = False) -> None:
        self.sse = sse
        self.strip = strip and sse
        self._buf = b""
        self.events = 0
        self.new = 0
        self.usage: Usage | None = None
        self.exact = False

    def chunk(self, data: bytes) -> bytes:
        """Look at one body chunk; returns the bytes to relay (``data`` itself unless :attr:`strip`: then the
        complete events so far, without the usage-only one). :attr:`new`: generated-token events it completed."""
        self.new = 0
        if not self.sse:
            if len(self._buf) < MAX_JSON:
                self._buf += data
            return data
        buf = self._buf + data if self._buf else data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b"" if self.strip else data
        done, self._buf = buf[: end + 2], buf[end + 2:]
        n = done.count(b"data:") - done.count(b"data: [DONE]")
        if _USAGE in done or _USAGE_SP in done:  # (_has_usage inlined: once per chunk of every metered stream)
            kept = []
            for event in done.split(b"\n\n")[:-1]:
                payload = event.lstrip()[5:].strip() if event.lstrip().startswith(b"data:") else b""
                u = _usage_of(payload) if _has_usage(event) else None
                if u is not None:
                    self.usage = u
                    if b'"choices":[]' in payload or b'"choices": []' in payload:
                        n -= 1  # the usage-only chunk generated nothing
                        if self.strip:
                            continue
                kept.append(event + b"\n\n")
            done = b"".join(kept)
        self.events += n
        self.new = n
        return done if self.strip else data

    def finish(self) -> Usage | None:
        """The engine's usage when the response carried one (then :attr:`exact` is True), else None."""
        if not self.sse and self._buf:
            self.usage = _usage_of(self._buf)
        self._buf = b""
        self.exact = self.usage is not None
        return self.usage


def _usage_of(payload: bytes) -> Usage | None:
    try:
        return _decode_body(payload).usage
    except msgspec.DecodeError:
        return None


def with_fields(body: bytes, fields: bytes) -> bytes:
    """``body`` (a JSON object) with ``fields`` (``"k":v`` pairs, comma-separated) written first; the rest of the
    bytes unchanged."""
    i = body.find(b"{")
    rest = body[i + 1:]
    sep = b"" if rest.lstrip().startswith(b"}") else b","
    return body[: i + 1] + fields + sep + rest


class _Limit(msgspec.Struct):
    max_tokens: Any = None
    max_completion_tokens: Any = None
    max_output_tokens: Any = None


_decode_limit = msgspec.json.Decoder(_Limit).decode


def output_limit(max_completion_tokens: Any, max_tokens: Any, max_output_tokens: Any) -> int:
    """The output-token limit of a request from its three fields' decoded values (the first positive integer, in
    that order), 0 when none is one."""
    for v in (max_completion_tokens, max_tokens, max_output_tokens):
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def _count(v: Any) -> int:
    """A positive whole number as vLLM's request model (pydantic, lax mode) reads an ``int`` field: an int, a bool,
    a float with no fraction or a string of one (``" 10 "``); 0 for anything else."""
    if isinstance(v, str):
        try:
            v = int(v.strip())
        except ValueError:
            return 0
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return v if isinstance(v, int) and v > 0 else 0


def sequences(n: Any, best_of: Any) -> int:
    """How many sequences a request generates from its ``n`` and ``best_of`` fields' decoded values: the larger
    (vLLM completions generate ``best_of`` sequences and return the best ``n``; OpenAI and vLLM chat generate
    ``n``), read as vLLM reads an integer field (:func:`_count`); 1 when neither is a positive integer."""
    return max(1, _count(n), _count(best_of))


def max_tokens(body: bytes) -> int:
    """The output-token limit a JSON body asks for (``max_tokens``, ``max_completion_tokens``,
    ``max_output_tokens``: :func:`output_limit`), 0 when none is an integer."""
    try:
        lim = _decode_limit(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0
    return output_limit(lim.max_completion_tokens, lim.max_tokens, lim.max_output_tokens)


__all__ = ["MAX_JSON", "Meter", "Usage", "max_tokens", "output_limit", "sequences", "with_fields"]
