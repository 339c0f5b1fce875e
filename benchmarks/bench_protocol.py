"""The router's client-side HTTP protocol alone: N keep-alive requests fed to ``bounded_protocol`` in one process.

Each request (``POST /v1/completions``, 3 headers, a 68-byte JSON body) is one ``data_received`` on a fake
transport; a stub direct handler answers it at once with a :class:`dplb.runtime.direct.DirectResponse` (4 headers,
a 2-byte body). No worker, no pick, no event-loop iteration: what is left is the parser, uvicorn's protocol as DPLB
extends it, and the response writing.

Count instructions, not time: the difference of two runs under callgrind, divided by N::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null python benchmarks/bench_protocol.py 0
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null python benchmarks/bench_protocol.py 20000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from dplb.runtime.direct import DirectResponse
from dplb.runtime.serving import bounded_protocol

BODY = b'{"model": "m", "prompt": "hello there, how are you", "max_tokens": 1}'
REQUEST = (b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n" % len(BODY) + BODY)
HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"2"), (b"x-sg-worker-id", b"0"),
           (b"x-request-id", b"abc")]


class _Transport:
    """Counts the bytes written; never pauses."""

    def __init__(self) -> None:
        self.written = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Handler:
    def wants(self, scope: dict[str, Any]) -> bool:
        return bool(scope["method"] == "POST")

    def begin(self, cycle: Any, start: Any) -> bool:
        out = DirectResponse(cycle)
        out.start(200, HEADERS)
        out.body(b"{}")
        out.end()
        return True


async def _noop_app(scope: Any, receive: Any, send: Any) -> None:
    return None


async def _run(n: int) -> int:
    cfg = uvicorn.Config(_noop_app, timeout_keep_alive=75)
    cfg.load()
    protocol = bounded_protocol(16384, None, _Handler())(cfg, ServerState(), {})
    transport = _Transport()
    protocol.connection_made(transport)
    for _ in range(n):
        protocol.data_received(REQUEST)
    return transport.written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("n", type=int, help="requests")
    args = ap.parse_args()
    written = asyncio.run(_run(args.n))
    print(f"{args.n} requests, {written} bytes written", file=sys.stderr)


if __name__ == "__main__":
    main()
