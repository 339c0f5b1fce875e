"""The one-of-each plumbing: the OpenAI error-body builder (dplb.errors), the bearer-token check
(dplb.router.intake), the JSON responder and the body-receive loop (dplb.runtime.asgi), driven with real ASGI
message sequences."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from dplb.errors import BodyTooLarge, RouterErrorKind, error_body, openai_error_body
from dplb.router.intake import Rejected, bearer_credential, bearer_ok
from dplb.router.intake import receive_body as router_receive_body
from dplb.runtime.asgi import receive_body, send_json, until_disconnect
from dplb.worker.engines.sim import http as sim_http
from dplb.worker.engines.sim.http import HTTPError, read_body


def _receiver(*messages: dict[str, Any]) -> Any:
    it = iter(messages)

    async def receive() -> dict[str, Any]:
        return next(it)

    return receive


def _body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


DISCONNECT = {"type": "http.disconnect"}


def test_error_bodies_are_compact_openai_json() -> None:
    """OpenAI's error object is message, type, param, code (``param`` null where no request parameter is named)."""
    assert openai_error_body("no — way", "invalid_request_error", "x") == (
        '{"error":{"message":"no — way","type":"invalid_request_error","param":null,"code":"x"}}'.encode())
    assert openai_error_body("m", "BadRequestError", 400) == (
        b'{"error":{"message":"m","type":"BadRequestError","param":null,"code":400}}')
    kind = RouterErrorKind.ALL_OVER_CAP
    assert json.loads(error_body(kind, "full")) == {"error": {"message": "full", "type": kind.type, "param": None,
                                                              "code": "all_workers_over_queue_cap"}}


def test_the_token_rate_429_has_openais_type_and_code_and_keeps_its_own_reason() -> None:
    kind = RouterErrorKind.TOKENS_RATE_LIMITED
    assert json.loads(error_body(kind, "m"))["error"] == {"message": "m", "type": "tokens", "param": None,
                                                          "code": "rate_limit_exceeded"}
    assert kind.code == "tokens_rate_limit_exceeded" and kind.status == 429  # the reason label stays apart
    assert len({k.code for k in RouterErrorKind}) == len(RouterErrorKind)  # one reason label per kind
    assert all(k.body_code == k.code for k in RouterErrorKind if k is not kind)
    assert HTTPError(404, "gone", "NotFoundError").body() == (
        b'{"error":{"message":"gone","type":"NotFoundError","param":null,"code":404}}')


@pytest.mark.parametrize(("header", "ok"), [
    (b"Bearer s3cret", True), (b"bearer s3cret", True), (b"BEARER s3cret", True), (b"Bearer s3cre", False),
    (b"Bearer s3cret ", False), (b"Basic s3cret", False), (b"", False), (b"s3cret", False)])
def test_bearer_check(header: bytes, ok: bool) -> None:
    cred = bearer_credential("s3cret")
    assert cred is not None and bearer_ok(header, cred) is ok
    assert bearer_credential("") is None and bearer_credential(None) is None


def test_receive_body_single_chunked_limit_and_disconnect(monkeypatch: pytest.MonkeyPatch) -> None:
    run = asyncio.run
    assert run(receive_body(_receiver(_body(b"abc")), 3)) == b"abc"
    assert run(receive_body(_receiver(_body(b"ab", True), _body(b"c", True), _body(b"")), 3)) == b"abc"
    assert run(receive_body(_receiver(DISCONNECT), 3)) is None
    assert run(receive_body(_receiver(_body(b"ab", True), DISCONNECT), 3)) is None
    with pytest.raises(BodyTooLarge, match="over the 3-byte limit"):
        run(receive_body(_receiver(_body(b"abcd")), 3))
    with pytest.raises(BodyTooLarge):  # refused at the chunk that crosses the limit; the rest is never received
        run(receive_body(_receiver(_body(b"ab", True), _body(b"cd", True)), 3))
    # The router's reading: None past the limit; a client gone before the body ended is a client close (499), not
    # bad input.
    assert run(router_receive_body(_receiver(_body(b"ab", True), _body(b"cd", True)), 3)) is None
    with pytest.raises(Rejected) as closed:
        run(router_receive_body(_receiver(_body(b"ab", True), DISCONNECT), 3))
    assert closed.value.kind is RouterErrorKind.CLIENT_CLOSED and closed.value.kind.status == 499
    # The sim engine's: 413 in vLLM's error shape.
    monkeypatch.setattr(sim_http, "MAX_BODY_BYTES", 8)
    with pytest.raises(HTTPError) as e:
        run(read_body(_receiver(_body(b"x" * 5, True), _body(b"x" * 5))))
    assert e.value.status == 413


def test_send_json_framing_and_until_disconnect() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(send_json(send, 503, b'{"a":1}', [(b"retry-after", b"1")]))
    assert sent == [{"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"7"), (b"retry-after", b"1")]},
        {"type": "http.response.body", "body": b'{"a":1}'}]
    asyncio.run(until_disconnect(_receiver(_body(b""), _body(b""), DISCONNECT)))  # returns at the disconnect
