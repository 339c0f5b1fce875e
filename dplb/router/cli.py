"""``dplb router``: command-line flags → :class:`dplb.config.RouterConfig` → :func:`dplb.router.app.run_router`."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from dplb.config import (
    LOG_FORMAT,
    MAX_ROUTER_PROCESSES,
    MIN_ROUTER_RESTART_AFTER_S,
    POLICIES,
    PREFIX_WEIGHTS,
    SEED_WEIGHTS,
    PolicyConfig,
    RouterConfig,
    default_router_processes,
    format_weights,
    parse_param,
    parse_weights,
    split_list,
)
from dplb.errors import ConfigError
from dplb.flags import PORT_ZERO_REFUSED, flag_number, flag_port
from dplb.policy.plugins import validate as validate_policy
from dplb.policy.prefix import ENTRY_BYTES
from dplb.stack import default_run_dir

#: Local routes that ``--api-key-exempt`` may open without a key (the proxied model routes never are).
EXEMPTABLE = ("/health", "/ready", "/metrics", "/metrics/host", "/v1/models", "/debug/decisions")
DEFAULT_EXEMPT = "/health,/ready,/metrics,/metrics/host"


_POLICY_DEFAULTS = PolicyConfig()


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """Scoring flags shared by ``dplb router`` and ``dplb launch``; defaults are :class:`PolicyConfig`'s."""
    d = _POLICY_DEFAULTS
    g = p.add_argument_group("routing policy")
    g.add_argument("--policy", choices=POLICIES, default=d.name, help="routing policy profile (default: %(default)s)")
    g.add_argument("--weights", default=None, metavar="NAME=W,…",
                   help=f"scorer weights, summing to 1 (default: {format_weights(PREFIX_WEIGHTS)} with prefix "
                   f"scoring on, the seed's {format_weights(SEED_WEIGHTS)} with --prefix-block-bytes 0; "
                   "positional 0.4,0.3,0.3 = queue,memory,latency)")
    g.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="soft queue cap of the queue term, requests; past it the term is relative to the longest "
                   "queue (default: %(default)s)")
    g.add_argument("--max-queue-from-worker", action="store_true", help="use each worker's max_num_seqs instead")
    g.add_argument("--hard-queue-cap", type=int, default=d.hard_queue_cap,
                   help="per-worker queue that makes it ineligible (0 = off; default: %(default)s)")
    g.add_argument("--memory-signal", choices=("kv", "gpu"), default=d.memory_signal,
                   help="KV-cache usage or NVML used/total (default: %(default)s)")
    g.add_argument("--latency-deadband", type=flag_number, default=d.latency_deadband,
                   help="latencies within this fraction of the workers' mean count as equal (0 = off; default: "
                   "%(default)s)")
    g.add_argument("--waiting-weight", type=flag_number, default=d.waiting_weight,
                   help="queue-term weight of a request that must wait for a batch slot (1 = seed's plain queue; "
                   "default: %(default)s)")
    g.add_argument("--latency-signal", choices=("e2e", "ttft"), default=d.latency_signal,
                   help="latency term input: mean E2E (seed) or mean TTFT of each worker's last 10 requests "
                   "(default: %(default)s)")
    g.add_argument("--prefix-block-bytes", type=int, default=d.prefix_block_bytes,
                   help="prefix-cache routing: prompt block size in bytes (0 = off; default: %(default)s)")
    g.add_argument("--prefix-index-blocks", type=int, default=d.prefix_index_blocks,
                   help=f"prefix index capacity, blocks (~{round(ENTRY_BYTES, -1)} bytes a block; default: "
                   "%(default)s)")
    g.add_argument("--prefix-ttl", type=flag_number, default=d.prefix_ttl_s,
                   help="forget a prefix block not sent for this long, seconds (default: %(default)s)")
    g.add_argument("--baseline-window", type=int, default=d.baseline_window,
                   help="requests whose P95 is the latency baseline (default: %(default)s)")
    g.add_argument("--seed", type=int, default=d.seed, help="RNG seed of random/power_of_two (default: %(default)s)")
    g.add_argument("--no-panic-routing", dest="panic_routing", action="store_false", default=d.panic_routing,
                   help="never route to a worker on heartbeat probation (once stale, fresh again for 5 state "
                   "intervals first), even when no other worker is routable: answer 503 no_routable_worker instead. "
                   "By default such a request goes to one of those workers (panic routing, reason 'panic')")
    g.add_argument("--policy-plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE first: it registers extra scorers for --weights (repeatable)")
    g.add_argument("--scorer-param", action="append", default=[], metavar="PLUGIN.PARAM=VALUE",
                   help="one parameter of a scorer or picker, e.g. prefix.block_bytes=64 or latency.deadband=0.1 "
                   "(repeatable; overrides the flag above that sets the same parameter). Built-in: "
                   f"{_param_list()}")


def _param_list() -> str:
    """``"prefix.block_bytes, prefix.ttl_s, …"``: every registered plugin parameter, for ``--help``."""
    from dplb.policy.framework import PICKERS, SCORERS

    return ", ".join(f"{name}.{p.name}" for table in (SCORERS, PICKERS) for name, cls in table.items()
                     for p in cls.parameters)


def router_argv(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> list[str]:
    """Every router and policy flag of ``args`` that differs from its default, as a command line (what
    ``--emit-systemd`` writes into ``DPLB_ROUTER_ARGS``): derived from :func:`add_router_args`, so no flag can be
    forgotten. ``--api-key`` is left out: a key never goes on a command line (it travels in ``DPLB_API_KEY``);
    ``skip``: other destinations the caller writes itself."""
    probe = argparse.ArgumentParser(add_help=False)
    add_router_args(probe)
    out: list[str] = []
    for action in probe._actions:
        if action.dest in ("help", "api_key") or action.dest in skip:
            continue
        value = getattr(args, action.dest)
        flag = action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out += [flag] if value != action.default else []
        elif isinstance(action, argparse._AppendAction):
            for v in value or ():
                out += [flag, str(v)]
        elif value is not None and value != action.default:
            out += [flag, str(value)]
    return out


def policy_config(args: argparse.Namespace, state_interval_ms: int = 200) -> PolicyConfig:
    """Build and validate the policy configuration from parsed flags (plugins loaded, scorer names checked).
    Raises :class:`ConfigError`."""
    cfg = PolicyConfig(
        name=args.policy, weights=parse_weights(args.weights) if args.weights else None, max_queue=args.max_queue,
        max_queue_from_worker=args.max_queue_from_worker, hard_queue_cap=args.hard_queue_cap,
        baseline_window=args.baseline_window, memory_signal=args.memory_signal,
        latency_signal=args.latency_signal, waiting_weight=args.waiting_weight,
        latency_deadband=args.latency_deadband, prefix_block_bytes=args.prefix_block_bytes,
        prefix_index_blocks=args.prefix_index_blocks, prefix_ttl_s=args.prefix_ttl,
        state_interval_ms=state_interval_ms, seed=args.seed, plugins=tuple(args.policy_plugin),
        params=tuple(parse_param(t) for t in args.scorer_param), panic_routing=args.panic_routing,
    )
    validate_policy(cfg)
    return cfg


def add_router_args(p: argparse.ArgumentParser) -> None:
    """Router flags shared by ``dplb router`` and ``dplb launch``."""
    p.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    p.add_argument("--port", type=flag_port, default=30000,
                   help=f"bind port, 1..65535 (default 30000; {PORT_ZERO_REFUSED})")
    p.add_argument("--api-key", default=os.environ.get("DPLB_API_KEY"),
                   help="require Authorization: Bearer KEY (default: $DPLB_API_KEY)")
    p.add_argument("--api-key-exempt", default=DEFAULT_EXEMPT, metavar="PATHS",
                   help=f"comma-separated paths served without the API key (default {DEFAULT_EXEMPT}; '' = none; "
                   f"allowed: {', '.join(EXEMPTABLE)})")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024,
                   help="larger request bodies get 413 body_too_large (default 33554432 = 32 MiB)")
    d: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
    p.add_argument("--first-byte-timeout", type=flag_number, default=d["first_byte_timeout_s"],
                   help=f"seconds to wait for a response head (default {d['first_byte_timeout_s']:g})")
    p.add_argument("--idle-timeout", type=flag_number, default=d["idle_timeout_s"],
                   help=f"seconds of silence allowed mid-response (default {d['idle_timeout_s']:g})")
    p.add_argument("--connect-timeout", type=flag_number, default=d["connect_timeout_s"],
                   help=f"seconds to connect to a worker's socket before trying the next worker (default "
                   f"{d['connect_timeout_s']:g})")
    p.add_argument("--stall-after", type=flag_number, default=d["stall_after_s"], metavar="S",
                   help="a worker with requests in flight whose engine made no progress (no token, no prefill step) "
                   "for S seconds is stalled: out of rotation, its in-flight requests failed with 504 "
                   f"worker_stalled, back once its progress resumes (default {d['stall_after_s']:g}; 0 = off)")
    p.add_argument("--header-timeout", type=flag_number, default=d["header_timeout_s"], metavar="S",
                   help="a client's request head must be complete S seconds after its first byte (a new "
                   "connection's: after the accept), else 408 request_timeout and the connection closed (default "
                   f"{d['header_timeout_s']:g})")
    p.add_argument("--body-timeout", type=flag_number, default=d["body_timeout_s"], metavar="S",
                   help="longest silence of a client mid-body before 408 request_timeout and the connection "
                   f"closed (default {d['body_timeout_s']:g}, nginx's client_body_timeout)")
    p.add_argument("--serve-half-closed", action="store_true",
                   help="answer a complete request whose client shut its sending side (shutdown(SHUT_WR), nc -N), "
                   "then close; by default that EOF is the client leaving and its request is aborted at once (a FIN "
                   "cannot tell a half-close from a client that closed and left)")
    p.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    p.add_argument("--no-direct-relay", dest="direct_relay", action="store_false",
                   help="serve every proxied request through the ASGI path (the direct relay, on by default, answers "
                   "the common request from the protocol callbacks with the same behaviour and less CPU)")
    p.add_argument("--router-processes", "--processes", dest="router_processes", type=int,
                   default=default_router_processes(),
                   help=f"router processes sharing the port (SO_REUSEPORT) and the state segment, under one parent "
                   f"(1..{MAX_ROUTER_PROCESSES}; default: one per 8 CPU cores, here %(default)s)")
    p.add_argument("--router-restart-after", "--restart-after", dest="router_restart_after", type=flag_number,
                   default=d["restart_after_s"], metavar="S",
                   help="a router process whose heartbeat in the state segment is S seconds old while it lives "
                   "(stopped, its event loop blocked: the kernel still hands it its share of new connections) is "
                   "SIGKILLed and restarted: each process of a --processes N group by the group's parent, a "
                   "single-process router by dplb launch (under systemd: the unit's WatchdogSec); 0 = never (a "
                   "group's children are then judged by their /health probes alone); at least "
                   f"{MIN_ROUTER_RESTART_AFTER_S:g} (default {d['restart_after_s']:g}, the router unit's WatchdogSec)")
    p.add_argument("--cors-allowed-origins", default=",".join(d["cors_allowed_origins"]), metavar="ORIGINS",
                   help="comma-separated origins allowed by CORS (answers preflights, adds the headers; '*' = any; "
                   "default '' = CORS off)")
    p.add_argument("--sse-keepalive", type=flag_number, default=d["sse_keepalive_s"], metavar="S",
                   help="send an SSE comment ': keep-alive' after S seconds without a worker byte on a stream (long "
                   "prefills behind proxies with idle timeouts; 0 = off, the default). --first-byte-timeout bounds the "
                   "wait for the worker's response head; --idle-timeout bounds its silence mid-stream either way")
    p.add_argument("--models-refresh", type=flag_number, default=d["models_refresh_s"], metavar="S",
                   help=f"seconds between two /v1/models fetches per worker for model-aware routing (default "
                   f"{d['models_refresh_s']:g}; a worker that becomes ready is asked at once)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, sent to every ready worker "
                   "(or ?workers=0,2); the workers need VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
    p.add_argument("--resume-streams", action="store_true",
                   help="when a worker dies or stalls mid-stream on a chat or completions stream with n = 1, re-issue "
                   "it to another worker with what the client already received as the continuation and stitch the "
                   "answer into the same stream (one [DONE], usage that adds up); refused, with the reason in the "
                   "error event, for n > 1, logprobs, structured outputs, tools and echo. Default off: the stream "
                   "ends with an error event")
    t = p.add_argument_group("tenants (docs/DESIGN.md §15)")
    t.add_argument("--tenants", default=None, metavar="FILE",
                   help="TOML file of tenants (keys as SHA-256 digests, weights, priority classes, limits, models; "
                   "`dplb tenants hash-key`, `dplb tenants check`); turns on the router's fair queue. SIGHUP reloads "
                   "it; a (re)start while it does not load uses its last good copy in the run dir (default: off, "
                   "one tenant 'default')")
    t.add_argument("--queue-max", type=int, default=d["queue_max"], metavar="N",
                   help=f"requests the fair queue holds at most; past it 429 (a tenant over its share) or 503 "
                   f"(default {d['queue_max']})")
    t.add_argument("--queue-timeout", type=flag_number, default=d["queue_timeout_s"], metavar="S",
                   help=f"seconds a request may wait in the fair queue before 429/503 (default "
                   f"{d['queue_timeout_s']:g})")
    t.add_argument("--engine-priority", action="store_true",
                   help="write the tenant's priority class rank (0 = first in [priorities] order) into the body's "
                   "'priority' field; the vLLM workers need --scheduling-policy priority")
    g = p.add_argument_group("fleet (a balancer in front of many hosts)")
    g.add_argument("--agent-port", type=flag_port, default=d["agent_port"], metavar="PORT",
                   help="answer HAProxy's agent-check on this TCP port (up NN%%, drain, down #reason from the host "
                   "load report; default: off)")
    g.add_argument("--orca", choices=("off", "asked", "always"), default=d["orca"],
                   help="add the ORCA endpoint-load-metrics header (application_utilization, rps_fractional) to "
                   "proxied responses: asked = when the request sends endpoint-load-metrics-format (default "
                   "%(default)s), always, or off")
    g.add_argument("--drain-notice", type=flag_number, default=d["drain_notice_s"], metavar="S",
                   help="on SIGTERM, report drain (agent, ORCA utilization 1, /ready 503) and keep serving S seconds "
                   "before stopping, so the front balancer moves traffic away first (default 0; a fleet: at least "
                   "the balancer's check interval x its fall count)")
    add_policy_args(p)


def parse_exempt(text: str) -> tuple[str, ...]:
    """``"/health,/metrics"`` → ``("/health", "/metrics")``; ``""`` → ``()``. Raises :class:`ConfigError` for a
    path that is not one of :data:`EXEMPTABLE`."""
    paths = tuple(split_list(text, "--api-key-exempt", allow_empty=True))
    bad = [p for p in paths if p not in EXEMPTABLE]
    if bad:
        raise ConfigError(f"--api-key-exempt: {', '.join(bad)} cannot be exempt; choose among {', '.join(EXEMPTABLE)} "
                          "(model routes always need the key)")
    return paths


def router_config(args: argparse.Namespace, *, run_dir: str, shm_path: str | None, num_workers: int | None,
                  state_interval_ms: int = 200) -> RouterConfig:
    """Build and validate the router configuration from parsed flags."""
    return RouterConfig(
        policy=policy_config(args, state_interval_ms), run_dir=run_dir, num_workers=num_workers, shm_path=shm_path,
        host=args.host, port=args.port, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
        public_paths=parse_exempt(getattr(args, "api_key_exempt", DEFAULT_EXEMPT)),
        connect_timeout_s=args.connect_timeout, first_byte_timeout_s=args.first_byte_timeout,
        idle_timeout_s=args.idle_timeout, access_log=args.access_log,
        cors_allowed_origins=tuple(split_list(args.cors_allowed_origins, "--cors-allowed-origins", allow_empty=True)),
        sse_keepalive_s=args.sse_keepalive, models_refresh_s=args.models_refresh,
        allow_runtime_lora=args.allow_runtime_lora, processes=args.router_processes,
        agent_port=args.agent_port, orca=args.orca, drain_notice_s=args.drain_notice,
        resume_streams=args.resume_streams, direct_relay=args.direct_relay,
        stall_after_s=args.stall_after, header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        serve_half_closed=args.serve_half_closed, restart_after_s=args.router_restart_after,
        tenants_file=_tenants_file(args.tenants, run_dir), queue_max=args.queue_max, queue_timeout_s=args.queue_timeout,
        engine_priority=args.engine_priority,
    )


def _tenants_file(path: str | None, run_dir: str) -> str | None:
    """``--tenants``: the absolute path of a file that loads, or of one with a last good copy in ``run_dir`` (the
    router starts on that copy and says so: :func:`dplb.tenants.load_tenants_or_last_good`). Checked now, so a bad
    file with nothing to fall back on stops the start with one line. Raises :class:`ConfigError`."""
    if path is None:
        return None
    from dplb.tenants import load_tenants_or_last_good

    path = os.path.abspath(path)
    load_tenants_or_last_good(path, run_dir)
    return path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``dplb router``."""
    p = sub.add_parser("router", help="run the OpenAI-compatible router in front of the workers",
                       description="Run the DPLB router. Workers are found through the shm segment "
                       "($DPLB_SHM_PATH) and their sockets in the run directory (<run-dir>/worker-K.sock).")
    add_router_args(p)
    p.add_argument("--run-dir", default=None, help=f"worker sockets directory (default {default_run_dir()})")
    p.add_argument("--shm-path", help="state segment (default $DPLB_SHM_PATH)")
    p.add_argument("--num-workers", type=int, help="number of workers (default: the segment's)")
    p.add_argument("--state-interval-ms", type=int, default=None, help="(default: the segment's)")
    # Set by `dplb launch` and by a router group's parent: the validated configuration is in $DPLB_ROUTER_CONFIG.
    p.add_argument("--config-env", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--process-index", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_router)


def _cmd_router(args: argparse.Namespace, rest: list[str]) -> int:
    from dplb.router.app import run_router
    from dplb.router.supervisor import config_from_env, run_group
    from dplb.runtime.serving import run_async
    from dplb.state.shm import ENV_SHM_PATH, Segment

    if args.config_env:
        cfg = config_from_env(args.process_index or 0)
        if args.process_index is not None:  # a group's child: say which one on every log line
            import logging

            for h in logging.getLogger().handlers:
                h.setFormatter(logging.Formatter(LOG_FORMAT.replace("%(name)s", f"%(name)s[{args.process_index}]")))
            return run_async(run_router(cfg))
        parent = os.getppid()  # dplb launch, which made the segment
        rc = run_group(cfg, args.log_level) if cfg.processes > 1 else run_async(run_router(cfg))
        _remove_abandoned(cfg.shm_path, parent)
        return rc
    interval = args.state_interval_ms
    shm_path = args.shm_path or os.environ.get(ENV_SHM_PATH)
    if interval is None and shm_path and os.path.exists(shm_path):
        with Segment.attach(shm_path, writable=False) as seg:
            interval = seg.state_interval_ms
    cfg = router_config(args, run_dir=args.run_dir or default_run_dir(), shm_path=shm_path,
                        num_workers=args.num_workers, state_interval_ms=interval or 200)
    if cfg.processes > 1:
        return run_group(cfg, args.log_level)
    return run_async(run_router(cfg))


def _remove_abandoned(shm_path: str | None, parent: int) -> None:
    """The router ``dplb launch`` started stops after the launcher died (its parent-death SIGTERM): remove the
    segment when this is the stack's last process (:func:`dplb.state.segments.remove_abandoned`; the workers,
    which wait for the router to stop, are usually the last)."""
    if not shm_path or os.getppid() == parent:
        return
    from dplb.state.segments import remove_abandoned

    if remove_abandoned(shm_path, parent):
        import logging

        logging.getLogger("dplb.router").info("removed the segment %s (its launcher, pid %d, is gone and no other "
                                              "process uses it)", shm_path, parent)
