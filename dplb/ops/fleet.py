"""Front-balancer configurations for a fleet of DPLB hosts: ``dplb fleet haproxy-config`` / ``envoy-config``.

Contract
- :func:`parse_hosts` reads ``HOST:PORT[/AGENT_PORT]`` entries (comma-separated); an empty item (a stray comma),
  a malformed entry, a port outside 1..65535 or a duplicate (one address in two spellings, a name in two cases)
  raises :class:`dplb.errors.ConfigError` naming it (one CLI line).
- Server names (:func:`server_names`) are readable and unique: ``h-`` and the address and port with every other
  character as ``-``, an IPv6 address with all eight groups, and ``-2``, ``-3``… on a name already taken (hosts
  differing only in punctuation). HAProxy sends the name to clients as ``x-dplb-host``.
- Retries, one rule for both balancers: a request is re-sent, each time to another host, only when it reached no
  engine, so nothing was generated: a connection that failed before the request was sent, or a 503 (DPLB answers
  503 only then: :class:`dplb.errors.RouterErrorKind`; ``no_routable_worker``, ``all_workers_over_queue_cap``, a
  draining worker's refusal, …). Never a 502/504 (``worker_stalled``, ``worker_failed``, ``worker_timeout``), an
  empty or cut response or a timeout: the host's engine may have started it, and a request that hangs or crashes
  an engine would take the next host down too. HAProxy: ``retry-on conn-failure 503`` with ``option redispatch 1``
  (every retry to another host; the default is the last only) and ``option http-buffer-request`` (without it a
  POST's body may not be in HAProxy's buffer yet when the answer comes, and the 503 is passed on: measured 18 of 20
  with HAProxy 2.6); Envoy: ``connect-failure``, ``refused-stream``, ``reset-before-request`` and
  ``retriable-status-codes`` 503 with the ``previous_hosts`` predicate, and a retry budget of 100 % of the requests
  in flight (Envoy's default circuit breaker allows 3 retries at once, and passes the other 503s on). Both at most 2
  retries; a request larger than the balancer's buffer (HAProxy ``tune.bufsize``, 16 KiB by default; Envoy's
  request buffer limit, 1 MiB by default) is never re-sent.
- :func:`haproxy_config` writes a complete ``haproxy.cfg`` (HAProxy ≥ 2.6): one backend, every host a server with
  an HTTP readiness check on ``/ready`` (503 while the host drains) and DPLB's agent-check (:mod:`dplb.router.agent`:
  ``up ready NN%`` sets the weight, ``drain`` stops new requests, ``down #reason`` takes it out). With
  ``stats_socket`` (``--stats-socket PATH``) HAProxy's admin socket is on (``show stat`` has each server's
  ``agent_status`` and ``last_agt``), else the config carries it, and a ``log`` stanza, commented out. ``balance`` is
  ``leastconn`` (fewest open connections ÷ weight: a streamed LLM request holds its connection, so a slow host's
  longer requests count against it at once; ``roundrobin`` on request); with ``affinity_header`` it is
  ``hdr(<name>)`` with ``hash-type consistent`` and
  ``hash-balance-factor`` (bounded-load consistent hashing: a conversation's turns stay on the host holding its KV
  cache, and spill once that host has more than factor/100 of the average load). ``option http-no-delay`` is on:
  without it HAProxy holds small writes back to fill packets, and a token stream (SSE) arrives in bursts (about
  ten tokens every ~220 ms instead of one every step).
- :func:`envoy_config` writes an Envoy v3 bootstrap (YAML): one listener, one cluster whose hosts are weighted by
  ``client_side_weighted_round_robin`` from the ORCA header DPLB adds (:mod:`dplb.router.orca`; the route asks for
  it with ``endpoint-load-metrics-format: TEXT`` and removes the report from the answer to the client: Envoy's
  router reads it from the upstream headers before it applies ``response_headers_to_remove``), an HTTP health
  check on ``/ready`` (1 s, 2 failures), the retries above (on another host each time), and outlier detection
  on local-origin failures only (2 consecutive connect failures or resets eject a host that died between health
  checks; HTTP 5xx answers never eject: a loaded DPLB host says so in its ORCA report, and ejecting it would pile
  its load on the others). The cluster is
  ``STATIC`` when every host is an IP literal and ``STRICT_DNS`` (IPv4 preferred) when any is a name (Envoy
  refuses a name in a static cluster). The admin listener is on ``127.0.0.1:--admin-port`` (0: none).
- When no host can take a request (every one down, draining or failing its connection), the balancer's own 503
  is DPLB's: the OpenAI-shaped ``no_routable_worker`` body (:data:`FLEET_DOWN_BODY`, built by
  :func:`dplb.errors.error_body`) with ``Content-Type: application/json`` and ``Retry-After: 1``, not HAProxy's HTML
  page or Envoy's ``text/plain`` "no healthy upstream" — an OpenAI SDK client reads it as it reads a host's 503.
  HAProxy: ``http-error status 503`` in ``defaults`` (HAProxy ≥ 2.2); Envoy: a ``local_reply_config`` mapper for
  status 503 (Envoy's local replies only; a host's own answer passes unchanged on both).
- Unreachable hosts are not an error when writing a config (the balancer's checks take them out); ``--probe``
  prints one warning line per host that does not answer ``/health``.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass

from dplb.config import split_list
from dplb.errors import ConfigError, RouterErrorKind, error_body
from dplb.flags import flag_port, flag_port_or_off

DEFAULT_AGENT_PORT = 30090
DEFAULT_ENVOY_ADMIN_PORT = 9901  # Envoy's conventional admin port, on 127.0.0.1 only
_HOST_RE = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):(?P<port>\d+)(?:/(?P<agent>\d+))?$")
ORCA_UPDATE_S = 1.0  # Envoy CSWRR weight_update_period (its default)
ORCA_BLACKOUT_S = 1.0  # Envoy CSWRR blackout_period: new weights are used after this long (Envoy default 10 s)
#: Envoy CSWRR weight_expiration_period (Envoy default 3 min). A host's weight (rps_fractional ÷ utilization) comes
#: only from the ORCA reports on its own answers, so a host whose last answers said utilization 1 (a stalled host's
#: 504s and 503s) keeps that near-zero weight while it gets no request, and gets none because of it: after a stall
#: Envoy starved a recovered host for 13-19 s (and up to the expiration period). Once a host's weight is older than
#: this, Envoy gives it the median weight of the others (its weight update; then ``blackout_period`` of fresh
#: reports before their weight counts), so a recovered host gets its share within this + ``weight_update_period``
#: of its last report. Under load every host answers many requests a second, so only a host Envoy sends nothing to
#: ages out; an idle one getting the median weight is right.
ORCA_EXPIRATION_S = 3.0
#: The body of the balancer's own 503 (module docstring): DPLB's ``no_routable_worker`` with the fleet's words (no
#: single quote, backslash or ``%``: HAProxy and Envoy take it literally).
FLEET_DOWN_BODY = error_body(RouterErrorKind.NONE_ROUTABLE, "no DPLB host can take the request now (every host is "
                             "down, draining or unreachable); retry later")
FLEET_DOWN_RETRY_AFTER_S = 1  # its Retry-After (DPLB's own 503s say 1 too)


@dataclass(frozen=True, slots=True)
class FleetHost:
    """One DPLB host: its router's address and the agent-check port."""

    host: str
    port: int
    agent_port: int = DEFAULT_AGENT_PORT

    @property
    def name(self) -> str:
        """A config-safe server name: ``h-127-0-0-2-30000``, ``h-gpu-1-example-30000``; an IPv6 address with
        every group written out (``[::1]:30000`` → ``h-0-0-0-0-0-0-0-1-30000``), so two addresses never share
        one. Names that differ only in punctuation can still meet: :func:`server_names` makes them unique."""
        try:
            ip = ipaddress.ip_address(self.host)
        except ValueError:
            return "h-" + re.sub(r"[^A-Za-z0-9]+", "-", f"{self.host}-{self.port}").strip("-")
        groups = ip.exploded.split(":") if ip.version == 6 else str(ip).split(".")
        return "h-" + "-".join(f"{int(g, 16):x}" if ip.version == 6 else g for g in groups) + f"-{self.port}"

    @property
    def key(self) -> tuple[str, int]:
        """What makes two entries one host: the address (an IP in one spelling, a name in lower case) and port."""
        try:
            return ipaddress.ip_address(self.host).compressed, self.port
        except ValueError:
            return self.host.lower().rstrip("."), self.port


def server_names(hosts: list[FleetHost]) -> list[str]:
    """Each host's :attr:`FleetHost.name`, unique: a name already taken gets ``-2``, ``-3``… (the first keeps it)."""
    taken: set[str] = set()
    out = []
    for h in hosts:
        name, n = h.name, 1
        while name in taken:
            n += 1
            name = f"{h.name}-{n}"
        taken.add(name)
        out.append(name)
    return out


def parse_hosts(text: str, default_agent_port: int = DEFAULT_AGENT_PORT) -> list[FleetHost]:
    """``"10.0.0.1:30000,10.0.0.2:30000/30091"`` → hosts. Raises :class:`ConfigError` (module docstring)."""
    out: list[FleetHost] = []
    for raw in split_list(text, "--hosts"):  # a stray comma is an error, as in every comma list
        m = _HOST_RE.match(raw)
        if m is None:
            raise ConfigError(f"--hosts: {raw!r} is not HOST:PORT or HOST:PORT/AGENT_PORT (e.g. 10.0.0.2:30000)")
        port, agent = int(m["port"]), int(m["agent"] or default_agent_port)
        if not (1 <= port <= 65535 and 1 <= agent <= 65535):
            raise ConfigError(f"--hosts: {raw!r}: ports must be 1..65535")
        h = FleetHost(m["host"].strip("[]"), port, agent)
        if any(o.key == h.key for o in out):  # one host written twice ([::1] and [0::1], Gpu1 and gpu1)
            raise ConfigError(f"--hosts: {h.host}:{h.port} is listed twice")
        out.append(h)
    return out


def haproxy_config(hosts: list[FleetHost], listen: str = "0.0.0.0:8080", *, affinity_header: str | None = None,
                   balance_factor: int = 150, agent_inter_ms: int = 500, check_inter_ms: int = 1000,
                   algorithm: str = "leastconn", stats_socket: str | None = None) -> str:
    """A complete ``haproxy.cfg`` (module docstring). Intervals in milliseconds; ``balance_factor`` ≥ 100;
    ``algorithm``: ``roundrobin`` or ``leastconn`` (without ``affinity_header``); ``stats_socket``: the admin
    socket's path (None: written commented out)."""
    if algorithm not in ("roundrobin", "leastconn"):
        raise ConfigError(f"--balance must be roundrobin or leastconn, got {algorithm!r}")
    if affinity_header is not None and not re.fullmatch(r"[A-Za-z0-9\-_]+", affinity_header):
        raise ConfigError(f"--affinity-header: {affinity_header!r} is not an HTTP header name")
    if balance_factor < 100:
        raise ConfigError(f"--hash-balance-factor must be ≥ 100 (percent of the average load), got {balance_factor}")
    balance = [f"balance {algorithm}"] if affinity_header is None else [
        f"balance hdr({affinity_header})", "hash-type consistent", f"hash-balance-factor {balance_factor}"]
    if stats_socket is not None and (not stats_socket.startswith("/") or any(c.isspace() for c in stats_socket)):
        raise ConfigError(f"--stats-socket: {stats_socket!r} must be an absolute path without spaces")
    servers = [f"    server {name} {_hp(h.host, h.port)} check agent-check agent-port {h.agent_port}"
               for h, name in zip(hosts, server_names(hosts), strict=True)]
    stats = (f"    stats socket {stats_socket} mode 600 level admin" if stats_socket else
             "    # stats socket /run/haproxy/dplb.sock mode 600 level admin  # or --stats-socket PATH")
    lines = [
        "# Written by `dplb fleet haproxy-config` (dplb.ops.fleet). DPLB hosts behind HAProxy:",
        "# /ready is the health check (503 while the host drains); the agent-check port sets each host's weight",
        "# from its load report (up ready NN% / drain / down #reason).",
        "global",
        "    maxconn 4096",  # two descriptors per connection: within a default 20000-fd limit
        "    # Each host's state, the agent's last answer included (agent_status, last_agt):",
        "    #   echo 'show stat' | socat stdio UNIX-CONNECT:<the socket below>",
        stats,
        "    # log /dev/log local0  # with `log global` and `option log-health-checks` below: agent/check changes",
        "defaults",
        "    mode http",
        "    # log global",
        "    # option httplog",
        "    # option log-health-checks",
        "    option http-keep-alive",
        "    option http-no-delay  # send each streamed token at once (without it HAProxy batches SSE chunks)",
        "    # Re-send a request only when it reached no engine, each time to another host: a failed connection, or",
        "    # a 503 (DPLB's 503s mean exactly that). Never a 502/504, an empty response or a response timeout: the",
        "    # host may have started generating (README, Running a fleet).",
        "    option redispatch 1",
        "    option http-buffer-request  # the body is kept for a retry (a POST's 503 is passed on without it)",
        "    retries 2",
        "    retry-on conn-failure 503",
        "    timeout connect 2s",
        "    timeout client 600s",
        "    timeout server 600s",
        "    timeout http-keep-alive 10s",
        "    # No host can take the request: DPLB's OpenAI-shaped 503 instead of HAProxy's HTML page",
        f"    http-error status 503 content-type application/json hdr retry-after {FLEET_DOWN_RETRY_AFTER_S} "
        f"string '{FLEET_DOWN_BODY.decode()}'",
        "frontend dplb",
        f"    bind {listen}",
        "    default_backend dplb_hosts",
        "backend dplb_hosts",
        *(f"    {b}" for b in balance),
        "    option httpchk GET /ready",
        "    http-check expect status 200",
        "    http-response set-header x-dplb-host %[srv_name]",
        f"    default-server inter {check_inter_ms}ms fall 2 rise 2 agent-inter {agent_inter_ms}ms weight 100",
        *servers,
    ]
    return "\n".join(lines) + "\n"


def _hp(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def envoy_config(hosts: list[FleetHost], listen: str = "0.0.0.0:8080", *, orca: bool = True,
                 admin_port: int = DEFAULT_ENVOY_ADMIN_PORT) -> str:
    """An Envoy v3 bootstrap as YAML (module docstring). ``orca=False``: plain round robin (for comparison);
    ``admin_port`` 0: no admin listener."""
    lhost, _, lport = listen.rpartition(":")
    if not lport.isdigit():
        raise ConfigError(f"--listen: {listen!r} is not HOST:PORT")
    if not 0 <= admin_port <= 65535:
        raise ConfigError(f"--admin-port must be 0 (none) or a TCP port 1..65535, got {admin_port}")
    admin = ("admin:\n"
             f"  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}\n") if admin_port else ""
    discovery = ("    type: STATIC\n" if all(_is_ip(h.host) for h in hosts) else
                 "    type: STRICT_DNS  # a host given by name: resolved, and re-resolved every 5 s\n"
                 "    dns_lookup_family: V4_PREFERRED\n")
    endpoints = "\n".join(
        f"          - endpoint:\n              address:\n                socket_address: "
        f"{{address: '{h.host}', port_value: {h.port}}}" for h in hosts)  # quoted: '::1' is no plain YAML
    if orca:
        policy = (
            "    load_balancing_policy:\n"
            "      policies:\n"
            "      - typed_extension_config:\n"
            "          name: envoy.load_balancing_policies.client_side_weighted_round_robin\n"
            "          typed_config:\n"
            '            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.'
            "client_side_weighted_round_robin.v3.ClientSideWeightedRoundRobin\n"
            f"            blackout_period: {ORCA_BLACKOUT_S:g}s\n"
            f"            weight_update_period: {ORCA_UPDATE_S:g}s\n"
            f"            weight_expiration_period: {ORCA_EXPIRATION_S:g}s  # a starved host's stale weight expires\n")
    else:
        policy = "    lb_policy: ROUND_ROBIN\n"
    ask = ("                request_headers_to_add:\n"
           "                - header: {key: endpoint-load-metrics-format, value: TEXT}\n"
           "                  append_action: OVERWRITE_IF_EXISTS_OR_ADD\n") if orca else ""
    return (
        "# Written by `dplb fleet envoy-config` (dplb.ops.fleet): DPLB hosts behind Envoy, weighted by the ORCA\n"
        "# load report DPLB adds to each response (application_utilization, rps_fractional).\n"
        f"{admin}"
        "static_resources:\n"
        "  listeners:\n"
        "  - name: dplb\n"
        f"    address: {{socket_address: {{address: '{lhost.strip('[]') or '0.0.0.0'}', port_value: {int(lport)}}}}}\n"
        "    filter_chains:\n"
        "    - filters:\n"
        "      - name: envoy.filters.network.http_connection_manager\n"
        "        typed_config:\n"
        '          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.'
        "HttpConnectionManager\n"
        "          stat_prefix: dplb\n"
        "          stream_idle_timeout: 600s\n"
        "          route_config:\n"
        "            virtual_hosts:\n"
        "            - name: dplb\n"
        "              domains: ['*']\n"
        "              routes:\n"
        "              - match: {prefix: /}\n"
        "                route:\n"
        "                  cluster: dplb_hosts\n"
        "                  timeout: 600s\n"
        "                  retry_policy:  # re-sent only when it reached no engine, each time to another host:\n"
        "                    # a failed connection or a 503 (DPLB's 503s mean exactly that; README, Running a fleet)\n"
        "                    retry_on: connect-failure,refused-stream,reset-before-request,retriable-status-codes\n"
        "                    retriable_status_codes: [503]\n"
        "                    num_retries: 2\n"
        "                    retry_host_predicate:\n"
        "                    - name: envoy.retry_host_predicates.previous_hosts\n"
        "                      typed_config:\n"
        '                        "@type": type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.'
        "PreviousHostsPredicate\n"
        "                    host_selection_retry_max_attempts: 3\n"
        f"{ask}"
        "                response_headers_to_add:\n"
        "                - header: {key: x-dplb-host, value: '%UPSTREAM_REMOTE_ADDRESS%'}\n"
        "                response_headers_to_remove: [endpoint-load-metrics]  # read by the LB first, then dropped\n"
        "          local_reply_config:  # no host can take it: DPLB's OpenAI-shaped 503, not text/plain\n"
        "            mappers:\n"
        "            - filter: {status_code_filter: {comparison: {op: EQ, value: {default_value: 503, "
        "runtime_key: dplb.fleet_down_status}}}}\n"
        "              headers_to_add:\n"
        f"              - header: {{key: retry-after, value: '{FLEET_DOWN_RETRY_AFTER_S}'}}\n"
        "                append_action: OVERWRITE_IF_EXISTS_OR_ADD\n"
        "              body_format_override:\n"
        f"                json_format: {FLEET_DOWN_BODY.decode()}\n"
        "                content_type: application/json\n"
        "          http_filters:\n"
        "          - name: envoy.filters.http.router\n"
        "            typed_config:\n"
        '              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router\n'
        "  clusters:\n"
        "  - name: dplb_hosts\n"
        f"{discovery}"
        "    connect_timeout: 2s\n"
        f"{policy}"
        "    common_lb_config: {healthy_panic_threshold: {value: 0}}  # a draining host never gets traffic back\n"
        "    circuit_breakers:  # every request in flight may be retried (the default allows 3 retries at once)\n"
        "      thresholds: [{retry_budget: {budget_percent: {value: 100}, min_retry_concurrency: 16}}]\n"
        "    outlier_detection:  # a host that died between health checks: out after 2 connect failures\n"
        "      split_external_local_origin_errors: true\n"
        "      consecutive_local_origin_failure: 2\n"
        "      enforcing_consecutive_local_origin_failure: 100\n"
        "      enforcing_consecutive_5xx: 0\n"
        "      enforcing_consecutive_gateway_failure: 0\n"
        "      enforcing_success_rate: 0\n"
        "      enforcing_local_origin_success_rate: 0\n"
        "      interval: 1s\n"
        "      base_ejection_time: 10s\n"
        "      max_ejection_percent: 50\n"
        "    health_checks:\n"
        "    - timeout: 1s\n"
        "      interval: 1s\n"
        "      no_traffic_interval: 1s\n"
        "      unhealthy_threshold: 2\n"
        "      healthy_threshold: 2\n"
        "      http_health_check: {path: /ready}\n"
        "    load_assignment:\n"
        "      cluster_name: dplb_hosts\n"
        "      endpoints:\n"
        "      - lb_endpoints:\n"
        f"{endpoints}\n")


def probe(hosts: list[FleetHost], timeout_s: float = 2.0) -> list[str]:
    """One warning line per host whose router does not answer ``GET /health`` (empty when all answer)."""
    out = []
    for h in hosts:
        try:
            with urllib.request.urlopen(f"http://{_hp(h.host, h.port)}/health", timeout=timeout_s) as r:
                if r.status == 200:
                    continue
                why = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:  # an answer, but not 200 (another server on that port: its status)
            why = f"HTTP {e.code} {e.reason}"
        except OSError as e:
            why = str(getattr(e, "reason", e))
        out.append(f"warning: {h.host}:{h.port} does not answer /health ({why}); the balancer keeps it out until "
                   "it does")
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``dplb fleet haproxy-config|envoy-config``."""
    p = sub.add_parser("fleet", help="write a front balancer's config for many DPLB hosts (HAProxy, Envoy)")
    fs = p.add_subparsers(dest="fleet_cmd", required=True, metavar="{haproxy-config,envoy-config}")
    for name, what in (("haproxy-config", "haproxy.cfg (agent-check weights)"),
                       ("envoy-config", "an Envoy bootstrap (ORCA client-side weighted round robin)")):
        q = fs.add_parser(name, help=f"print {what}")
        q.add_argument("--hosts", required=True, metavar="HOST:PORT[/AGENT],…", help="the DPLB routers")
        q.add_argument("--listen", default="0.0.0.0:8080", help="the balancer's address (default %(default)s)")
        q.add_argument("--agent-port", type=flag_port, default=DEFAULT_AGENT_PORT,
                       help="agent-check port of hosts listed without one (default %(default)s)")
        q.add_argument("--probe", action="store_true", help="warn (stderr) about hosts that do not answer /health")
        q.add_argument("-o", "--output", help="write to this file instead of stdout")
        if name == "haproxy-config":
            q.add_argument("--affinity-header", default=None, metavar="NAME",
                           help="consistent hashing with bounded load on this request header (e.g. x-session-id)")
            q.add_argument("--hash-balance-factor", type=int, default=150,
                           help="with --affinity-header: a host takes at most this percent of the average load "
                           "(default %(default)s)")
            q.add_argument("--balance", choices=("roundrobin", "leastconn"), default="leastconn",
                           help="HAProxy's algorithm without --affinity-header (default %(default)s)")
            q.add_argument("--stats-socket", metavar="PATH", default=None,
                           help="turn on HAProxy's admin socket at PATH (`show stat`: each host's agent_status and "
                           "last_agt); default: written commented out")
        else:
            q.add_argument("--round-robin", action="store_true", help="plain round robin (no ORCA weights)")
            q.add_argument("--admin-port", type=flag_port_or_off, default=DEFAULT_ENVOY_ADMIN_PORT,
                           help="Envoy's admin listener on 127.0.0.1 (0: none; default %(default)s)")
    p.set_defaults(func=_cmd_fleet)


def _cmd_fleet(args: argparse.Namespace, rest: list[str]) -> int:
    hosts = parse_hosts(args.hosts, args.agent_port)
    if args.fleet_cmd == "haproxy-config":
        text = haproxy_config(hosts, args.listen, affinity_header=args.affinity_header,
                              balance_factor=args.hash_balance_factor, algorithm=args.balance,
                              stats_socket=args.stats_socket)
    else:
        text = envoy_config(hosts, args.listen, orca=not args.round_robin, admin_port=args.admin_port)
    if args.probe:
        for line in probe(hosts):
            print(line, file=sys.stderr)
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(text)
        except OSError as e:
            raise ConfigError(f"-o {args.output}: cannot write it: {e.strerror or e}") from None
    else:
        with contextlib.suppress(BrokenPipeError):
            sys.stdout.write(text)
    return 0


__all__ = ["DEFAULT_AGENT_PORT", "DEFAULT_ENVOY_ADMIN_PORT", "FLEET_DOWN_BODY", "FleetHost", "add_parser",
           "envoy_config", "haproxy_config", "parse_hosts", "probe", "server_names"]
