"""What ``dplb launch`` checks and writes around the stack (split out of :mod:`dplb.ops.launcher`).

- :func:`check_ports`: every TCP port the stack will bind (router, agent-check, each worker's metrics port) can be
  bound, before anything starts; the error names the port, its owner in the stack and the flag that moves it
  (:mod:`dplb.ops.ports`, which ``dplb doctor`` uses too). Two of the stack's own ports on one port are refused
  by :func:`check_launch_flags`, before anything is bound.
- :func:`check_socket_paths`: each worker socket path fits a Unix socket and is free or a (stale) socket.
- :func:`check_model`: a local ``--model`` path exists and is a model directory (not found after 3 start attempts).
- :func:`root_cause`: the line of a worker log that says why it failed (vLLM's ``ValueError … decrease
  --gpu-memory-utilization`` sits above a page of shutdown tracebacks).
- :func:`scrape_targets`: Prometheus ``file_sd`` target groups of the stack (jobs ``dplb-router``, ``dplb-workers``,
  the names the alert rules expect; every group labelled ``stack``, :func:`stack_label`, which the dashboards select
  a stack's router and workers by), written by ``dplb launch`` and ``--emit-systemd``. A wildcard bind
  (``0.0.0.0``, ``::``) is written as ``--scrape-host``, else this host's FQDN; :func:`loopback_targets` is the
  one-line warning both print when that FQDN resolves only to loopback (a remote Prometheus could not reach it).
- :func:`child_argv`: how children are started: ``python -P -m dplb.cli`` (``-P``: the current directory is not put
  first on ``sys.path``, so a ``dplb/`` folder there cannot shadow the installed package; ``PYTHONPATH`` still
  applies).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import re
import shlex
import socket
import stat
import sys

from dplb.config import check_stall
from dplb.errors import ConfigError
from dplb.ops.doctor import model_path_problem
from dplb.ops.ports import clash, stack_ports, try_bind
from dplb.stack import stack_metrics_port_base, worker_metrics_ports

#: The scrape jobs the alert rules and dashboards expect.
ROUTER_JOB, WORKERS_JOB = "dplb-router", "dplb-workers"
#: The target label naming the stack a router or worker target belongs to (the dashboards' ``$stack`` variable).
STACK_LABEL = "stack"
#: A ``--stack-name``: the dashboards put it inside a PromQL string (``stack="$stack"``) and Grafana shows it in a
#: drop-down, so letters, digits and ``._:@-`` only (no quotes, backslashes, spaces), 1..128 characters.
_STACK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
TARGETS_FILE = "prometheus-targets.json"
#: Bind addresses that mean "every interface": no target can name them, so a host name is written instead.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
#: A ``--scrape-host`` DNS name (RFC 1123 labels, 253 characters at most); an IP literal is taken as well.
_DNS_NAME = re.compile(r"(?=.{1,253}$)(?!-)[A-Za-z0-9-]{1,63}(?<!-)(?:\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")
_ERROR_LINE = re.compile(r"^(?:\S+ )*?(\w*(?:Error|Exception)|error): (.+)$")
_WRAPPERS = ("See root cause above", "Engine core initialization failed")


def child_argv(*args: str) -> list[str]:
    """``[python, -P, -m, dplb.cli, *args]``: the cwd cannot shadow the package (see the module docstring)."""
    return [sys.executable, "-P", "-m", "dplb.cli", *args]


def check_ports(host: str, port: int, metrics_host: str, metrics_ports: list[int], agent_port: int | None = None
                ) -> None:
    """Bind-test the router port, the HAProxy agent-check port (when on; the router binds it on ``host``) and every
    worker metrics port (:func:`dplb.ops.ports.stack_ports`). Raises :class:`ConfigError` for two of them on one
    port, else for the first one that cannot be bound, naming what would have used it and the flag that changes
    it."""
    uses = stack_ports(host, port, metrics_host, metrics_ports, agent_port)
    err = clash(uses)
    for use in uses:
        if err is not None:
            raise err
        err = try_bind(use)
    if err is not None:
        raise err


#: Longest Unix socket path Linux accepts (``sun_path`` is 108 bytes with its terminating NUL; unix(7)).
MAX_SOCKET_PATH_BYTES = 107


def check_socket_paths(paths: list[str]) -> None:
    """Every worker socket path can be bound: short enough for a Unix socket and, when something is there
    already, a socket (a stale one is replaced; a live one is refused before, by
    :func:`dplb.ops.doctor.live_sockets`). Raises :class:`ConfigError` naming the path and ``--run-dir``."""
    for p in paths:
        if len(os.fsencode(p)) > MAX_SOCKET_PATH_BYTES:
            raise ConfigError(f"the worker socket path {p} is {len(os.fsencode(p))} bytes, over the "
                              f"{MAX_SOCKET_PATH_BYTES} a Unix socket allows; pass a shorter --run-dir")
        if os.path.lexists(p) and not stat.S_ISSOCK(os.lstat(p).st_mode):
            raise ConfigError(f"{p} exists and is not a socket; remove it or pass another --run-dir")


def check_launch_flags(args: argparse.Namespace, num_workers: int) -> int:
    """Refuse bad ``dplb launch`` supervision flags (what the launcher and ``--emit-systemd`` both check before
    anything is started or written): ``--drain-timeout``, ``--port``, ``--metrics-port-base``, ``--stall-after`` /
    ``--stall-restart-after`` (:func:`dplb.config.check_stall`), ``--max-start-failures``, two of the stack's
    ports on one port (``--port``, ``--agent-port``, the metrics ports: :func:`dplb.ops.ports.clash`), ``--stack-name``
    (resolved in place to the stack's label, its default filled in: :func:`stack_label`), ``--scrape-host``
    (:func:`check_scrape_host`). Returns the metrics port
    base (0 = off). Raises :class:`ConfigError` naming the flag."""
    if not (math.isfinite(args.drain_timeout) and args.drain_timeout >= 0):
        raise ConfigError(f"--drain-timeout must be a finite number ≥ 0 seconds, got {args.drain_timeout}")
    if not 1 <= args.port <= 65535:  # before the metrics ports derived from it
        raise ConfigError(f"--port must be 1..65535, got {args.port}")
    mbase = stack_metrics_port_base(args.port, args.metrics_port_base)
    if not (mbase == 0 or 1 <= mbase <= 65535 - num_workers):
        raise ConfigError(f"--metrics-port-base must be 0 (off) or a port with room for {num_workers} "
                          f"workers, got {mbase}" + ("" if args.metrics_port_base is not None else
                                                      f" (--port {args.port} + 1): pass --metrics-port-base"))
    err = clash(stack_ports(args.host, args.port, args.metrics_host, worker_metrics_ports(mbase, num_workers),
                            args.agent_port))
    if err is not None:  # the stack's own ports on one port: a configuration error, found before anything binds
        raise err
    check_stall(args.stall_after, args.stall_restart_after if args.stall_after else None)
    if args.max_start_failures < 1:
        raise ConfigError("--max-start-failures must be ≥ 1")
    args.stack_name = stack_label(args.port, args.stack_name)
    args.scrape_host = check_scrape_host(args.scrape_host, args.host, args.metrics_host, mbase != 0)
    return mbase


def check_scrape_host(scrape_host: str | None, host: str, metrics_host: str, metrics: bool) -> str | None:
    """Refuse a ``--scrape-host`` that is not a host name or IP address (no port, no scheme), or that no target
    would use (neither ``--host`` nor, with worker metrics on, ``--metrics-host`` is a wildcard). Returns it as the
    targets take it: an IPv6 address given in brackets (``[::1]``, as in a URL) without them (:func:`_target` adds
    them back after the port is appended). Raises :class:`ConfigError`."""
    if scrape_host is None:
        return None
    bracketed = scrape_host.startswith("[") and scrape_host.endswith("]")
    name = scrape_host[1:-1] if bracketed else scrape_host
    try:
        version = ipaddress.ip_address(name).version
    except ValueError:
        if bracketed:
            raise ConfigError(f"--scrape-host: {scrape_host!r} is bracketed but {name!r} is not an IPv6 address "
                              "(e.g. [fd00::5])") from None
        if not _DNS_NAME.fullmatch(name):
            raise ConfigError(f"--scrape-host must be a host name or IP address without a port (e.g. "
                              f"gpu-node-3.example.com, 10.0.0.5 or fd00::5), got {scrape_host!r}") from None
    else:
        if bracketed and version != 6:
            raise ConfigError(f"--scrape-host: only an IPv6 address goes in brackets, got {scrape_host!r} (write "
                              f"{name})")
    if host not in WILDCARD_HOSTS and not (metrics and metrics_host in WILDCARD_HOSTS):
        raise ConfigError("--scrape-host names this host in the scrape targets of a wildcard bind, and none is one: "
                          "pass --host 0.0.0.0 and/or --metrics-host 0.0.0.0 with it (or drop it)")
    return name


def check_model(model: str | None) -> None:
    """Refuse a ``--model`` that is a missing or non-model local path. Raises :class:`ConfigError`."""
    if model:
        problem = model_path_problem(model)
        if problem:
            raise ConfigError(f"{problem}. Pass the model directory (with config.json) or a Hugging Face id")


def root_cause(log_text: str) -> str:
    """The first ``SomeError: message`` line of a log that is not a wrapper pointing elsewhere ("" when none)."""
    for line in log_text.splitlines():
        m = _ERROR_LINE.match(line.strip())
        if m and not any(w in line for w in _WRAPPERS):
            return line.strip()
    return ""


def _target(host: str, port: int, scrape_host: str | None) -> str:
    """``HOST:PORT`` of a Prometheus target for a listener bound to ``host`` (an IPv6 literal in brackets)."""
    if host in WILDCARD_HOSTS:
        host = scrape_host or socket.getfqdn()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def loopback_targets(host: str, metrics_host: str, metrics: bool, scrape_host: str | None,
                     fqdn: str | None = None) -> str | None:
    """The one-line warning for targets a Prometheus on another host cannot reach, or None. It is said when the
    workers' metrics (``metrics`` on) bind a wildcard ``metrics_host`` — what one does for a remote Prometheus; the
    default loopback metrics make the file a local Prometheus's anyway, so the default wildcard router ``--host``
    alone says nothing — and the name written for it resolves only to loopback addresses: without ``--scrape-host``
    this host's FQDN (``fqdn``, default :func:`socket.getfqdn`; also when it does not resolve at all), e.g.
    ``/etc/hosts`` maps the host name to 127.0.0.1 and ``getfqdn()`` is ``localhost``; with it, ``scrape_host``
    itself (``127.0.0.1``, ``::1``, ``localhost``; a name that does not resolve here may resolve where Prometheus
    runs, so it is not judged)."""
    if not metrics or metrics_host not in WILDCARD_HOSTS:
        return None
    flags = [f"--{n} {h}" for n, h in (("host", host), ("metrics-host", metrics_host)) if h in WILDCARD_HOSTS]
    name = scrape_host if scrape_host is not None else fqdn if fqdn is not None else socket.getfqdn()
    try:
        addrs = {str(a[4][0]) for a in socket.getaddrinfo(name, None)}
    except OSError:
        addrs = set()
    if (scrape_host is not None and not addrs) or (
            addrs and not all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addrs)):
        return None
    where = f"resolves only to loopback ({', '.join(sorted(addrs))})" if addrs else "does not resolve"
    said = "--scrape-host" if scrape_host is not None else "its FQDN"
    return (f"the scrape targets of {' and '.join(flags)} name this host {name!r} ({said}), which {where}: a "
            "Prometheus on another host cannot reach them; pass --scrape-host with the address it reaches this "
            "host by")


def stack_label(port: int, given: str | None) -> str:
    """The ``stack`` label value of the stack whose router listens on ``port``: ``given`` (``--stack-name``) when
    set, else ``<this host's name>:<port>`` (``socket.gethostname()``, e.g. ``gpu-node-3:30000``): unique per host
    and router port, the same whatever address the router or the workers' metrics bind (``127.0.0.2``,
    ``localhost``, ``0.0.0.0``), and stable across restarts. On Kubernetes the pod name is the host name, and the
    PodMonitor writes ``<pod>:<port>`` the same way. Raises :class:`ConfigError` for a name outside
    :data:`_STACK_NAME`."""
    name = given if given is not None else f"{socket.gethostname()}:{port}"
    if not _STACK_NAME.fullmatch(name):
        where = "--stack-name" if given is not None else "the default (this host's name): pass --stack-name"
        raise ConfigError(f"{where}: a stack name is 1..128 letters, digits and ._:@- (starting with a letter or "
                          f"digit), got {name!r}")
    return name


def scrape_targets(host: str, port: int, metrics_host: str, metrics_ports: list[int], stack: str,
                   scrape_host: str | None = None) -> list[dict[str, object]]:
    """``file_sd`` target groups: the router (``host:port``) and each worker's metrics port, with ``job`` labels
    and the ``stack`` label (:func:`stack_label`) on both, so a stack's workers are found by name rather than by
    address (a wildcard bind address is written as ``scrape_host``, else this host's FQDN)."""
    groups: list[dict[str, object]] = [{"targets": [_target(host, port, scrape_host)],
                                        "labels": {"job": ROUTER_JOB, STACK_LABEL: stack}}]
    if metrics_ports:
        groups.append({"targets": [_target(metrics_host, p, scrape_host) for p in metrics_ports],
                       "labels": {"job": WORKERS_JOB, STACK_LABEL: stack}})
    return groups


def write_scrape_targets(directory: str, groups: list[dict[str, object]]) -> str:
    """Write ``groups`` to ``directory``/:data:`TARGETS_FILE` atomically (Prometheus re-reads file_sd files on
    change). Returns the path."""
    path = os.path.join(directory, TARGETS_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(groups, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def parse_worker_args(items: list[str], num_workers: int) -> dict[int, list[str]]:
    """``["K=ARGS", ...]`` → ``{K: shlex-split ARGS}`` (several items for one K add up). Raises
    :class:`ConfigError` for a malformed item or K outside 0..num_workers−1."""
    out: dict[int, list[str]] = {}
    for item in items:
        k_s, sep, rest = item.partition("=")
        try:
            k = int(k_s)
            words = shlex.split(rest)
        except ValueError as e:
            raise ConfigError(f"--worker-args {item!r}: expected K=ARGS, e.g. '3=--sim-speed 0.5' ({e})") from e
        if not sep or not 0 <= k < num_workers:
            raise ConfigError(f"--worker-args {item!r}: expected K=ARGS with K in 0..{num_workers - 1}")
        out.setdefault(k, []).extend(words)
    return out
