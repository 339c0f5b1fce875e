"""``python -m dplb.worker.engines.sim --uds PATH | --port P [--<sim knob> VALUE …]``: serve one sim engine.

Contract: one ``--<knob>`` flag per :class:`~dplb.worker.engines.sim.scheduler.SimConfig` field (its type and
default from the dataclass), validated by ``SimConfig`` itself; the engine is served by uvicorn on the Unix socket
``--uds`` or on ``--host``/``--port`` until interrupted, then shut down.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import fields

from dplb.worker.engines.sim.engine import SimConfig, SimEngine


def main(argv: list[str] | None = None) -> None:
    """``python -m dplb.worker.engines.sim --uds PATH | --port P [--<sim knob> VALUE …]``: serve one sim engine."""
    ap = argparse.ArgumentParser(prog="python -m dplb.worker.engines.sim", description="Serve the DPLB sim engine.")
    ap.add_argument("--uds", help="Unix socket path to serve on")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--log-level", default="warning")
    for f in fields(SimConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default), default=f.default,
                        help=f"(default {f.default!r})")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = SimConfig(**{f.name: getattr(args, f.name) for f in fields(SimConfig)})

    async def serve() -> None:
        import uvicorn

        engine = SimEngine(cfg)
        await engine.start()
        assert engine.app is not None
        server = uvicorn.Server(uvicorn.Config(engine.app, uds=args.uds, host=args.host, port=args.port,
                                               lifespan="off", log_level=args.log_level))
        try:
            await server.serve()
        finally:
            await engine.shutdown()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
