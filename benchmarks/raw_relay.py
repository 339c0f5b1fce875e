"""The floor of bench_router's added latency: a byte relay with nothing of a router in it.

``python benchmarks/raw_relay.py PORT SOCKET``: listens on 127.0.0.1:PORT; each client connection gets its own
connection to the Unix socket SOCKET, and bytes go both ways unchanged (uvloop, asyncio protocols, one
``write`` per read, no parsing, no decision). Prints ``ready`` once listening; runs until killed.

What a request routed through it costs over talking to the socket directly is what any extra process in the
path costs on this host (a TCP hop instead of the client's Unix-socket one, and two more wake-ups); a router's
added latency minus this relay's is the router's own work (bench_router.py prints both).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import uvloop


class _Upstream(asyncio.Protocol):
    """The worker's side: bytes to the client."""

    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class _Client(asyncio.Protocol):
    """The client's side: bytes to the worker (held until the worker's connection is up)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.up: Any = None
        self.held: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        up, _ = await asyncio.get_running_loop().create_unix_connection(lambda: _Upstream(self.transport), self.path)
        self.up = up
        for data in self.held:
            up.write(data)
        self.held.clear()

    def data_received(self, data: bytes) -> None:
        if self.up is None:
            self.held.append(data)
        else:
            self.up.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None:
            self.up.close()


async def _serve(port: int, path: str) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: _Client(path), "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("port", type=int, help="TCP port to listen on, on 127.0.0.1")
    ap.add_argument("socket", help="the worker's Unix socket")
    args = ap.parse_args()
    uvloop.run(_serve(args.port, args.socket))
