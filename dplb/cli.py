"""The ``dplb`` command line: ``launch``, ``worker``, ``router``, ``state``, ``doctor``, ``segment``, ``bench``,
``usage``, ``tenants``.

Contract: argparse parses and validates into typed ``*Config`` objects once; a :class:`dplb.errors.DPLBError` is
printed as one clear message without a traceback (exit 2 for configuration errors, 1 otherwise), prefixed with
the (sub)command given (``dplb tenants hash-key: error: …``); a usage error is one line too, naming the subcommand and
its ``--help`` (exit 2). Subcommands
import their modules lazily so ``dplb state`` stays fast and the router never imports engine code. Every command
first refuses a compiled build that may not run (partial: exit 1; stale: exit 75,
:class:`dplb.errors.StaleBuildError`), before any of its modules is imported: this module imports none of
:data:`dplb.native.HOT_MODULES`.
"""

# ruff: noqa: E402  (the imports after the SIGINT guard come after it on purpose)
from __future__ import annotations

import os
import signal
import sys

# Run as the program (the ``dplb`` console script, or ``python -m dplb.cli``), an early Ctrl-C ends the process
# quietly (SIGINT's default action) while the modules load; main() restores Python's KeyboardInterrupt. Imported
# as a library (tests), nothing changes.
_ENTRY = __name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") == "dplb"
if _ENTRY:
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import argparse
import logging
import typing
from collections.abc import Sequence

from dplb import __version__, native
from dplb.config import LOG_FORMAT, PREFIX_BLOCK_BYTES, STALL_AFTER_S, STALL_RESTART_AFTER_S
from dplb.errors import DPLBError, NativeBuildError, StaleBuildError
from dplb.flags import flag_number, flag_port_or_off
from dplb.stack import METRICS_HOST, METRICS_PORT_BASE


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT, stream=sys.stderr)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class _HelpEngine(argparse.Action):
    """``--help-engine sim|vllm``: print that engine's arguments and exit (like ``--help``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        if values == "sim":
            from dplb.worker.engines import sim_arg_parser

            sp = sim_arg_parser()
            sp.description = ("Sim engine knobs (pass after the worker's own flags, or to `dplb launch`; "
                              "units and faults: dplb/worker/engines/sim/scheduler.py SimConfig).")
            sp.print_help()
        else:
            print("The vllm engine passes every argument it does not know to vLLM's OpenAI server unchanged; see "
                  "`vllm serve --help` (or `python -m vllm.entrypoints.openai.api_server --help`).")
        parser.exit(0)


# ---- worker ----------------------------------------------------------------------------------------------------
def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker", help="run one worker (engine on a Unix socket + state collector)",
        description="Run one DPLB worker. Arguments after the known ones go to the engine: --sim-* knobs for the "
        "sim engine (`dplb worker --help-engine sim`), vLLM server arguments for the vllm engine.",
        allow_abbrev=False,  # unknown arguments go to the engine: a prefix must not silently become a DPLB flag
    )
    p.add_argument("--worker-id", type=int, required=True, help="slot index in the shm segment (0-based)")
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    p.add_argument("--uds", required=True, help="Unix socket path the worker serves the OpenAI API on")
    p.add_argument("--model", help="model path/name (vllm) or served model name (sim)")
    p.add_argument("--shm-path", help="state segment (default: $DPLB_SHM_PATH)")
    p.add_argument("--state-interval-ms", type=int, help="publish interval (default: the segment's, 200)")
    p.add_argument("--metrics-port", type=flag_port_or_off,
                   help=f"metrics port (default {METRICS_PORT_BASE}+K; 0 = off)")
    p.add_argument("--metrics-host", default=METRICS_HOST,
                   help=f"address the metrics port binds (default {METRICS_HOST}; 0.0.0.0 for a remote Prometheus)")
    p.add_argument("--help-engine", choices=("sim", "vllm"), action=_HelpEngine,
                   help="show the engine's own arguments (the sim's --sim-* knobs; vLLM's server flags) and exit")
    p.add_argument("--drain-timeout", type=flag_number, default=30.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--stall-after", type=flag_number, default=STALL_AFTER_S, metavar="S",
                   help="the router's --stall-after: requests in flight and no engine progress for S s is a stall "
                   f"(default {STALL_AFTER_S:g}; 0 = off)")
    p.add_argument("--stall-restart-after", type=flag_number, default=STALL_RESTART_AFTER_S, metavar="S",
                   help="stalled S s since the engine's last progress: stop pinging systemd's watchdog and exit 1 so "
                   f"the supervisor restarts the worker (default {STALL_RESTART_AFTER_S:g}; 0 = never)")
    p.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=True,
                   help="follow the engine's KV-cache events and publish what it holds to the routers' prefix index "
                   "(default on; needs pyzmq and an engine that publishes them: the sim does)")
    p.add_argument("--prefix-block-bytes", type=int, default=PREFIX_BLOCK_BYTES, metavar="N",
                   help="the routers' --prefix-block-bytes (the keys the KV events are translated into; 0 = off)")
    p.set_defaults(func=_cmd_worker)


def _cmd_worker(args: argparse.Namespace, rest: list[str]) -> int:
    from dplb.worker.engines import build_engine
    from dplb.worker.process import Worker, WorkerConfig

    cfg = WorkerConfig(
        worker_id=args.worker_id, uds=args.uds, shm_path=args.shm_path, state_interval_ms=args.state_interval_ms,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, drain_timeout_s=args.drain_timeout,
        stall_after_s=args.stall_after, stall_restart_after_s=args.stall_restart_after,
        kv_events=args.kv_events, prefix_block_bytes=args.prefix_block_bytes,
    )
    engine = build_engine(args.engine, rest, model=args.model)
    worker = Worker(cfg, engine)
    from dplb.runtime.serving import run_async

    return run_async(worker.run())


# ---- state -----------------------------------------------------------------------------------------------------
def _add_state(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("state", help="show the shared-memory state segment (one row per worker)")
    p.add_argument("--shm-path", help="segment (default: $DPLB_SHM_PATH, else the only /dev/shm/dplb_state_*; with "
                   "several, they are listed and one must be chosen)")
    p.add_argument("--shm-dir", default=None, help=argparse.SUPPRESS)  # tests: where to look instead of /dev/shm
    p.add_argument("--json", action="store_true", help="print JSON: {header, workers: [...]}")
    p.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C")
    p.add_argument("--interval", type=flag_number, default=1.0, help="--watch refresh period, seconds")
    p.add_argument("--tenants", default=None, metavar="FILE",
                   help="the router's tenants file, to name the tenants of the router processes' shared tenant "
                   "tables (default: the last good copy the router keeps in the segment's run directory; "
                   "without either they show as their 56-bit tags in hex)")
    p.set_defaults(func=_cmd_state)


def _cmd_state(args: argparse.Namespace, rest: list[str]) -> int:
    from dplb.ops.state_cli import run_state

    return run_state(args.shm_path, as_json=args.json, watch=args.watch, interval_s=args.interval,
                     directory=args.shm_dir, tenants=args.tenants)


# ---- segment (for systemd's dplb-segment.service) ----------------------------------------------------------
def _add_segment(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("segment", help="create or remove the shm state segment (systemd's dplb-segment.service)")
    p.add_argument("action", choices=("create", "remove"), metavar="{create,remove}")
    p.add_argument("--shm-path", help="segment path (default $DPLB_SHM_PATH)")
    p.add_argument("--num-workers", type=int, help="slots (default $DPLB_NUM_WORKERS)")
    p.add_argument("--state-interval-ms", type=int, help="(default $DPLB_STATE_INTERVAL_MS or 200)")
    p.add_argument("--model", default="", help="served model name recorded in the header")
    p.add_argument("--force", action="store_true",
                   help="remove: even while live routers or workers use it (they keep serving on the router's own "
                        "counts, and a launcher's frozen-worker watchdog is off until a segment is back)")
    p.set_defaults(func=_cmd_segment)


def _cmd_segment(args: argparse.Namespace, rest: list[str]) -> int:
    import os

    from dplb.config import check_state_interval_ms
    from dplb.errors import ConfigError
    from dplb.ops.systemd_units import SYSTEMD_SHM_PATH
    from dplb.state.layout import ENV_SHM_PATH, MAX_WORKERS, check_not_foreign
    from dplb.state.shm import Segment, resolve_path

    if not (args.shm_path or os.environ.get(ENV_SHM_PATH)):
        raise ConfigError(f"dplb segment {args.action} needs the segment's path: pass --shm-path PATH (or set "
                          f"{ENV_SHM_PATH}; the systemd units' is {SYSTEMD_SHM_PATH})")
    path = resolve_path(args.shm_path)
    check_not_foreign(path)  # never overwrite or remove a file that is not a DPLB segment
    if args.force and args.action != "remove":
        raise ConfigError("--force applies to `dplb segment remove` only (create never replaces a live segment)")
    if not args.force:
        _refuse_live_segment(path, args.action)
    if args.action == "remove":
        from dplb.state.segments import inspect

        live = inspect(path).live_pids if os.path.lexists(path) else []
        try:
            os.unlink(path)
        except FileNotFoundError:
            return 0
        print(f"removed {path}" + (f" while pids {', '.join(map(str, live))} used it (--force): their routers serve "
                                   "on their own counts until a segment is back (dplb segment create)" if live else ""))
        return 0
    n = _int_flag(args.num_workers, "--num-workers", "DPLB_NUM_WORKERS", "")
    if not 1 <= n <= MAX_WORKERS:
        raise ConfigError(f"--num-workers (or DPLB_NUM_WORKERS) must be 1..{MAX_WORKERS}, got {n}")
    interval = check_state_interval_ms(_int_flag(args.state_interval_ms, "--state-interval-ms",
                                                 "DPLB_STATE_INTERVAL_MS", "200"))
    Segment.create(path, n, state_interval_ms=interval, model=args.model, replace=True,
                   run_dir=os.environ.get("DPLB_RUN_DIR", "")).close()
    print(f"created {path} ({n} workers, {interval} ms)")
    return 0


def _int_flag(value: int | None, flag: str, env: str, default: str) -> int:
    """``value`` when the flag was given, else ``$env`` (else ``default``; "" reads as 0) as an integer. Raises
    :class:`dplb.errors.ConfigError` naming the flag and the variable when the variable is not an integer."""
    import os

    from dplb.errors import ConfigError

    if value is not None:
        return value
    raw = os.environ.get(env, default).strip() or "0"
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{flag} (from ${env}) must be an integer, got {raw!r}") from None


def _refuse_live_segment(path: str, action: str) -> None:
    """``dplb segment create`` over a segment that live processes use would wipe their state (``dplb state`` then
    shows ``model=-``), and ``remove`` would take the state plane from under them (routers fall back to their own
    counts, a launcher's frozen-worker watchdog goes off): refuse both the way ``dplb launch`` does
    (:func:`dplb.state.segments.check_takeover`), and say how to stop each kind of stack (``remove --force``
    overrides). Raises :class:`dplb.errors.ShmPathError`."""
    from dplb.errors import ShmPathError
    from dplb.state.segments import check_takeover

    try:
        check_takeover(path)
    except ShmPathError as e:
        force = " (or `dplb segment remove --force` to remove it anyway)" if action == "remove" else ""
        raise ShmPathError(f"{e}. To stop it: Ctrl-C its `dplb launch`, or `systemctl stop dplb.target` for the "
                           f"systemd units (which recreate the segment when started){force}", path) from e


# ---- entry point ---------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """The CLI's parser class (every subcommand's too: ``add_subparsers`` makes them of the parent's class): a
    usage error is one line naming the (sub)command, ``dplb state: error: … (see `dplb state --help`)``, exit 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The full ``dplb`` parser."""
    p = _Parser(prog="dplb", description="DPLB: data-parallel load balancer for vLLM")
    p.add_argument("--version", action="version", version=f"dplb {__version__}")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_worker(sub)
    _add_state(sub)
    _add_segment(sub)
    from dplb.bench import cli as bench_cli
    from dplb.ops import doctor, fleet, launch_cli, usage
    from dplb.router import cli as router_cli

    launch_cli.add_parser(sub)
    router_cli.add_parser(sub)
    doctor.add_parser(sub)
    bench_cli.add_parser(sub)
    fleet.add_parser(sub)
    usage.add_parsers(sub)
    return p


# Subcommands whose unknown arguments are passed on (to the engine); the others reject them.
_PASS_THROUGH = {"worker", "launch"}


def _leaf_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command that was given (``dplb state``, ``dplb tenants hash-key``): its errors name
    that command and show its usage, not the whole CLI's."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[name]


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point. Returns the exit code (130 after Ctrl-C, at any point: while the subcommands'
    modules are imported too, so an early Ctrl-C prints one line, never a traceback)."""
    command = "dplb"
    if _ENTRY:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # Before any subcommand's module (and so any compiled module) is imported: a partial build crashes.
        build = native.build()
        problem = build.refusal(native.accept_stale())
        if problem:
            raise (NativeBuildError if build.partial else StaleBuildError)(problem)
        parser = build_parser()
        args, rest = parser.parse_known_args(argv)
        leaf = _leaf_parser(parser, args)
        command = leaf.prog
        if rest and args.command not in _PASS_THROUGH:
            leaf.error(f"unrecognized arguments: {' '.join(rest)}")
        _setup_logging(args.log_level)
        return int(args.func(args, rest) or 0)
    except DPLBError as e:
        print(f"{command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"\n{command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dplb state --json | head`: the reader went away
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
