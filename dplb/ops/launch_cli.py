"""``dplb launch``'s command line: its flags (the router's and the placement's included) and the command, which
runs a :class:`dplb.ops.launcher.Launcher` (or writes systemd env files with ``--emit-systemd``).

Contract: flags only, validated by their argparse types; every default here is the one the docs name. The router's
flags are :func:`dplb.router.cli.add_router_args`'s, ``--router-restart-after`` among them: its one value goes to
the router group's parent in the router configuration (it judges each child) and to the launcher (it judges a
single-process router), so the two never judge one process by different limits. Raises :class:`ConfigError` for a
segment path that already exists.
"""

from __future__ import annotations

import argparse

from dplb.config import STALL_RESTART_AFTER_S
from dplb.errors import ConfigError
from dplb.flags import flag_number, flag_port_or_off
from dplb.ops.launcher import Launcher
from dplb.ops.placement import add_placement_args
from dplb.router.cli import add_router_args
from dplb.stack import METRICS_HOST, METRICS_PORT_BASE, default_run_dir
from dplb.state.shm import MAX_WORKERS


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``dplb launch``."""
    p = sub.add_parser(
        "launch", help="start workers + router on this machine and supervise them (the main job)",
        description="Start N workers (vLLM with --model; the sim engine without) and the router, supervise them, "
        "and clean up on Ctrl-C. Unknown arguments are passed to every worker's engine (vLLM server arguments, or "
        "--sim-* knobs).",
        allow_abbrev=False,  # unknown arguments go to the engines: `--engine` must not silently be --engine-priority
    )
    p.add_argument("--model", help="model path or name for vLLM (omit for the sim engine)")
    p.add_argument("--served-model-name", help="model name clients use (default: --model, or dplb-sim)")
    p.add_argument("--num-workers", type=int,
                   help=f"data-parallel workers, 1..{MAX_WORKERS} (default: GPUs / TP; 2 on CPU)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per worker (default 1)")
    p.add_argument("--state-interval-ms", type=int, default=200, help="worker publish interval (default 200)")
    p.add_argument("--run-dir", help=f"sockets and logs (default {default_run_dir()}, or …-PORT with another --port)")
    p.add_argument("--shm-path", help="state segment path (default $DPLB_SHM_PATH, else "
                   "/dev/shm/dplb_state_<unix seconds>_<pid>); an existing path must be a stale DPLB segment")
    p.add_argument("--drain-timeout", type=flag_number, default=30.0,
                   help="seconds workers get to finish in-flight requests on stop (default 30)")
    p.add_argument("--metrics-port-base", type=flag_port_or_off, default=None,
                   help=f"worker K serves metrics on BASE+K (default {METRICS_PORT_BASE}+K, or --port+1+K with "
                   "another --port; 0 disables)")
    p.add_argument("--metrics-host", default=METRICS_HOST,
                   help=f"address the workers' metrics ports bind (default {METRICS_HOST}; 0.0.0.0 for a remote "
                   "Prometheus)")
    p.add_argument("--scrape-host", metavar="HOST",
                   help="the host name or address a Prometheus reaches this host by, written into the scrape "
                   "targets for a wildcard --host / --metrics-host (default: this host's FQDN; a warning says when "
                   "that, or the one given, resolves only to loopback; an IPv6 address may be bracketed)")
    p.add_argument("--stack-name", metavar="NAME",
                   help="the stack label of this stack's Prometheus targets (router and workers), which the "
                   "dashboards' Stack variable selects by (default HOSTNAME:PORT, e.g. gpu-node-3:30000; letters, "
                   "digits and ._:@-)")
    p.add_argument("--max-start-failures", type=int, default=3,
                   help="give up after a worker fails to start N times in a row before becoming ready (default 3)")
    p.add_argument("--stall-restart-after", type=flag_number, default=STALL_RESTART_AFTER_S, metavar="S",
                   help="a worker stalled (--stall-after) S seconds since its engine's last progress exits and is "
                   f"restarted, its engine processes killed (default {STALL_RESTART_AFTER_S:g}; 0 = never)")
    p.add_argument("--remove-logs", action="store_true", help="remove the run directory and its logs on exit")
    p.add_argument("--worker-args", action="append", metavar="K=ARGS",
                   help="extra engine arguments for worker K only, after the shared ones (repeatable), e.g. "
                   "--worker-args '3=--sim-speed 0.5' (a throttled GPU) or '0=--max-num-seqs 128'")
    add_placement_args(p)
    p.add_argument("--emit-systemd", metavar="DIR", help="write systemd env files for this plan into DIR and exit")
    add_router_args(p)
    p.set_defaults(func=_cmd_launch)


def _cmd_launch(args: argparse.Namespace, rest: list[str]) -> int:
    if args.emit_systemd:
        from dplb.ops.systemd_units import emit_env_files

        return emit_env_files(args, rest)
    try:
        return Launcher(args, rest).run()
    except FileExistsError as e:
        raise ConfigError(f"{e}; pass another --shm-path or remove the old segment (dplb doctor)") from e
