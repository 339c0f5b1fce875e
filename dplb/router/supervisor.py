"""``dplb router --processes N``: N router processes on one port and one state segment, under one parent
(docs/DESIGN.md §7).

One router process is one core: ~13 µs of CPU per streamed token caps it near 75k tokens/s, below what an 8-GPU
server streams. The state plane is shared memory, so N processes can route on it together:

- The parent reserves the port (a bound, non-listening ``SO_REUSEPORT`` socket: it takes no connections but keeps
  another program from taking the port between two child starts) after checking nothing else holds it, then
  starts N children ``dplb router --config-env --process-index i`` with the validated
  :class:`~dplb.config.RouterConfig` as JSON in ``$DPLB_ROUTER_CONFIG`` (no flag is re-emitted, so none can be
  forgotten). Each child listens on the port with ``SO_REUSEPORT`` (the kernel spreads connections over them) and on
  its private socket :meth:`~dplb.config.RouterConfig.process_socket` (siblings merge metrics/decisions through it).
- Routing: each child publishes its in-flight correction in its router slot and adds the others'
  (:mod:`dplb.state.router_slots`), so a burst spread over N processes is spread over the workers like one router's.
- Supervision: a child that exits while the group runs is restarted at once (then with a backoff doubling from
  0.5 s to 10 s while it keeps failing within :data:`STABLE_S`); connections the dead child had accepted are lost,
  the other children's are not. After :data:`MAX_START_FAILURES` exits in a row before listening the parent gives
  up (exit 1, the child's exit status in the log; exit 75, :class:`~dplb.errors.StaleBuildError`'s, when the last
  one refused a stale compiled build, so ``dplb launch`` retries the group as it retries one router) — only when no
  other child serves: while one does, the failing child is retried every :data:`BACKOFF_MAX_S` (one missing process
  is not worth stopping the healthy ones). A child refused for a stale build is not started again while the
  parent's own check of the build (the one the child's start runs, :mod:`dplb.native`) still refuses it: each such
  retry counts as a refused start, and one line about it is logged at most every
  :data:`dplb.native.STALE_RETRY_LOG_S` (the child's own refusal line is printed once).
- Liveness, by heartbeat: every :data:`HEARTBEAT_EVERY_S` the parent reads its listening children's router slots in
  the segment (``cfg.shm_path``, mapped read-only and followed: a removed or replaced file is dropped, the one now
  at the path attached) by pid; a child whose slot's heartbeat (written by its monitor every ≤ 0.5 s) is older than
  ``cfg.restart_after_s`` (``--restart-after``, dplb launch's ``--router-restart-after``: one value, so the parent
  and the launcher never judge a process differently; 0 = off) while it lives is SIGKILLed (one WARNING naming it,
  its pid and the age) and restarted as after any exit. The kernel keeps handing a stopped process its share of the
  new connections, so waiting strands clients. Under ``dplb launch`` the parent judges its children and the
  launcher judges none of them one by one; it judges the group by them (:mod:`dplb.ops.watchdog`: no living child
  of this parent with a fresh heartbeat for ``cfg.restart_after_s`` plus this module's :data:`BACKOFF_MAX_S` and a
  start means this parent is stopped or wedged).
- Liveness, fallback: every :data:`HEALTH_EVERY_S` the parent asks each child's private socket for ``/health``; a
  child that gives no HTTP answer :data:`HUNG_AFTER` times in a row (stopped, or its event loop stuck) is SIGKILLed
  and restarted. This alone judges a child without a slot to read: no segment (missing, not yet created, one
  being recreated), a slot not written yet, ``--restart-after 0``.
- Signals: SIGTERM/SIGINT are forwarded to every child; each drains (stops accepting, finishes its in-flight
  requests within the router's graceful window); children still running after :data:`STOP_TIMEOUT_S` are
  SIGKILLed. Exit code 0 when every child stopped cleanly, 1 otherwise.
- systemd: the parent alone speaks to systemd (``READY=1`` once every child listens, ``STATUS=``, watchdog pings
  while every child is alive); children get no ``NOTIFY_SOCKET``. Children die with the parent (``PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from dplb import native
from dplb.config import RouterConfig
from dplb.errors import ConfigError, ShmError, StaleBuildError, bind_error
from dplb.runtime.procs import die_with_parent
from dplb.runtime.sd_notify import Watchdog, notify
from dplb.state.follow import SegmentFollower
from dplb.state.shm import Segment

log = logging.getLogger("dplb.router")
ENV_CONFIG = "DPLB_ROUTER_CONFIG"
STABLE_S = 10.0  # a child that ran this long before exiting restarts without backoff
BACKOFF_START_S, BACKOFF_MAX_S = 0.5, 10.0
MAX_START_FAILURES = 5
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0  # the router's own graceful window (5 s) + its stop wait (10 s) + margin
HEALTH_EVERY_S = 2.0
HEALTH_TIMEOUT_S = 1.0
HUNG_AFTER = 5  # failed health probes in a row (≈ 10 s) before a child counts as hung (the heartbeat judges first)
HEARTBEAT_EVERY_S = 0.25  # how often the children's router slots are read: adds ≤ this to --restart-after
_ENV_DROP = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@dataclass
class _Member:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    listening: bool = False
    failures: int = 0
    backoff_s: float = BACKOFF_START_S
    next_start: float = 0.0
    restarts: int = 0
    next_probe: float = 0.0
    failed_probes: int = 0
    stale: bool = False  # its last start was refused for a stale build (exit 75)
    stale_log_at: float = 0.0  # while so: when the next line about it may be logged


def reserve_port(host: str, port: int) -> socket.socket:
    """Check that ``host:port`` is free (a plain bind, which fails if any socket holds it, ``SO_REUSEPORT`` ones
    included), then hold it with a bound but non-listening ``SO_REUSEPORT`` socket. Port 0 picks a free port
    (``getsockname()``). Raises :class:`ConfigError` naming ``--port``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:  # socket.gaierror: a host that does not resolve
        raise bind_error(host, port, e) from e
    family, socktype, proto, _, addr = infos[0]
    probe = socket.socket(family, socktype, proto)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(addr)
        addr = probe.getsockname()  # port 0 → the port the kernel chose
    except OSError as e:
        raise bind_error(host, port, e) from e
    finally:
        probe.close()
    hold = socket.socket(family, socktype, proto)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    hold.bind(addr)
    return hold


def check_run_dir(cfg: RouterConfig) -> None:
    """The children bind their private sockets in ``cfg.run_dir``: it must be a writable directory and the longest
    socket path must fit ``AF_UNIX``'s 107 bytes. Raises :class:`ConfigError` naming ``--run-dir``."""
    if not os.path.isdir(cfg.run_dir) or not os.access(cfg.run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"--run-dir {cfg.run_dir} is not a writable directory; the router processes bind their "
                          "sockets there (create it, or pass the workers' run directory)")
    longest = cfg.process_socket(cfg.processes - 1).replace(f"-{cfg.port}.", "-65535.")
    if len(longest.encode()) > 107:
        raise ConfigError(f"--run-dir {cfg.run_dir} is too long for a Unix socket path ({longest} is "
                          f"{len(longest.encode())} bytes, at most 107); use a shorter directory")


def child_env(cfg: RouterConfig, base: dict[str, str] | None = None, notify: bool = False) -> dict[str, str]:
    """The environment of a router process started with ``--config-env``: ``base`` (default: this process's), with
    the configuration in ``$DPLB_ROUTER_CONFIG`` and the API key in ``$DPLB_API_KEY`` (never in a file or on a
    command line). ``notify=False`` drops systemd's notify socket (a group's parent speaks for its children)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k != "DPLB_API_KEY" and (notify or k not in _ENV_DROP)}
    env[ENV_CONFIG] = cfg.to_json().decode()
    if cfg.api_key:
        env["DPLB_API_KEY"] = cfg.api_key
    return env


def config_from_env(process_index: int) -> RouterConfig:
    """The configuration a parent handed this child (``$DPLB_ROUTER_CONFIG``), as process ``process_index``.
    Raises :class:`ConfigError` when it is missing or invalid."""
    raw = os.environ.get(ENV_CONFIG)
    if not raw:
        raise ConfigError(f"--config-env: ${ENV_CONFIG} is not set (it is set by `dplb router --processes N` and "
                          "`dplb launch`; run `dplb router` with flags instead)")
    cfg = RouterConfig.from_json(raw.encode(), os.environ.get("DPLB_API_KEY"))
    return dataclasses.replace(cfg, process_index=process_index)


class RouterGroup:
    """The parent of ``cfg.processes`` router processes (module docstring). :meth:`run` blocks until stopped."""

    def __init__(self, cfg: RouterConfig, log_level: str = "info") -> None:
        self.cfg = cfg
        self.log_level = log_level
        self.members = [_Member(i) for i in range(cfg.processes)]
        self.stopping = False
        self._hold: socket.socket | None = None
        self._segment: SegmentFollower | None = None  # the segment the children's heartbeats are read from
        self._next_beat = 0.0

    def _argv(self, i: int) -> list[str]:
        return [sys.executable, "-P", "-m", "dplb.cli", "--log-level", self.log_level, "router", "--config-env",
                "--process-index", str(i)]

    def _start(self, m: _Member) -> None:
        m.proc = subprocess.Popen(self._argv(m.index), env=child_env(self.cfg), stdin=subprocess.DEVNULL,
                                  preexec_fn=die_with_parent)
        m.started_at = time.monotonic()
        m.listening = False

    def _answers_health(self, m: _Member) -> bool:
        """True when the child's private socket answers ``GET /health`` with any HTTP status within
        :data:`HEALTH_TIMEOUT_S` (a 401 under an API key still proves its loop runs)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(HEALTH_TIMEOUT_S)
        try:
            s.connect(self.cfg.process_socket(m.index))
            s.sendall(b"GET /health HTTP/1.1\r\nhost: dplb\r\nconnection: close\r\n\r\n")
            return s.recv(16).startswith(b"HTTP/1.1 ")
        except OSError:
            return False
        finally:
            s.close()

    def _probe(self, m: _Member, now: float) -> None:
        """Liveness probe of a listening child (module docstring): SIGKILL it once it is hung."""
        if now < m.next_probe or m.proc is None:
            return
        m.next_probe = now + HEALTH_EVERY_S
        if self._answers_health(m):
            m.failed_probes = 0
            return
        m.failed_probes += 1
        if m.failed_probes >= HUNG_AFTER:
            log.error("router process %d (pid %d) gave no /health answer %d times in a row; killing it", m.index,
                      m.proc.pid, m.failed_probes)
            m.failed_probes = 0
            m.proc.kill()

    def _current_segment(self) -> Segment | None:
        """The segment now at ``cfg.shm_path`` (mapped read-only, followed), or None: judging by heartbeat is off,
        or there is no segment there yet."""
        if self.cfg.restart_after_s <= 0 or not self.cfg.shm_path:
            return None
        if self._segment is None:
            try:
                seg = Segment.attach(self.cfg.shm_path, writable=False)
            except ShmError:
                return None  # not created yet: the probes judge meanwhile; tried again next time
            self._segment = SegmentFollower(seg, who="router group", log=log, writable=False,
                                            while_missing="its processes are judged by their /health probes alone")
        return self._segment.current()

    def _kill_frozen(self, now: float) -> None:
        """SIGKILL each listening child whose router slot's heartbeat is older than ``cfg.restart_after_s`` while
        it lives (module docstring); its exit is then seen and it is restarted as after any exit. A child with no
        slot in the segment (not written yet, a recreated segment) is left to the probes."""
        if now < self._next_beat:
            return
        self._next_beat = now + HEARTBEAT_EVERY_S
        seg = self._current_segment()
        if seg is None:
            return
        ages: dict[int, float] = {}
        for slot in seg.router_slots():
            age = slot["heartbeat_age_s"]
            if age is not None:  # two slots of one pid (a reused pid's stale slot): the fresher is its own
                ages[slot["pid"]] = min(age, ages.get(slot["pid"], age))
        limit = self.cfg.restart_after_s
        for m in self.members:
            if m.proc is None or not m.listening or m.proc.poll() is not None:
                continue
            age = ages.get(m.proc.pid)
            if age is None or age <= limit:
                continue
            log.warning("router process %d (pid %d) published no heartbeat for %.1f s (--restart-after %g) though it "
                        "lives (stopped, or its event loop blocked); killing it to restart it", m.index, m.proc.pid,
                        age, limit)
            m.failed_probes = 0
            m.proc.kill()

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.stopping:
            log.info("%s received: draining %d router processes", signal.Signals(signum).name, len(self.members))
        self.stopping = True

    def _forward_drain(self, signum: int, frame: object) -> None:
        """SIGUSR1 (report drain to the front balancer, dplb.router.host_report) and SIGHUP (reload the tenants
        file, dplb.router.tenancy): passed on to every child."""
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    m.proc.send_signal(signum)

    def run(self) -> int:
        """Reserve the port, start the children, supervise them until SIGTERM/SIGINT, stop them. Returns the exit
        code (0: every child stopped cleanly)."""
        check_run_dir(self.cfg)
        self._hold = reserve_port(self.cfg.host, self.cfg.port)
        self.cfg = dataclasses.replace(self.cfg, port=self._hold.getsockname()[1])
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGUSR1, self._forward_drain)
        signal.signal(signal.SIGHUP, self._forward_drain)
        try:
            for m in self.members:
                self._start(m)
            rc = self._supervise()
        finally:
            stop_rc = self._stop()
            self._hold.close()
            if self._segment is not None:
                self._segment.close()
            log.info("DPLB router group stopped")
        return rc or stop_rc

    def _supervise(self) -> int:
        watchdog = Watchdog()
        ready = False
        while not self.stopping:
            now = time.monotonic()
            self._kill_frozen(now)
            for m in self.members:
                assert m.proc is not None or m.next_start
                if m.proc is not None and m.proc.poll() is None:
                    if m.listening:
                        self._probe(m, now)
                    elif self._answers_health(m):
                        m.listening, m.failures, m.stale = True, 0, False
                        m.next_probe, m.failed_probes = now + HEALTH_EVERY_S, 0
                        log.info("router process %d listening (pid %d)", m.index, m.proc.pid)
                    elif now - m.started_at > START_TIMEOUT_S:
                        log.error("router process %d not listening after %.0f s; killing it", m.index,
                                  START_TIMEOUT_S)
                        m.proc.kill()
                    continue
                if m.proc is not None:  # just exited
                    rc = m.proc.returncode
                    m.proc = None
                    if self._exited(m, rc, now):
                        return StaleBuildError.exit_code if rc == StaleBuildError.exit_code else 1
                if now >= m.next_start:
                    m.next_start = 0.0
                    if m.stale and native.inspect_build().refusal(native.accept_stale()):
                        if self._exited(m, StaleBuildError.exit_code, now):  # refused as the child would be
                            return StaleBuildError.exit_code
                        continue
                    m.restarts += 1
                    self._start(m)
            all_up = all(m.listening and m.proc is not None for m in self.members)
            if all_up and not ready:
                ready = True
                log.info("DPLB router group: %d processes on port %d", len(self.members), self.cfg.port)
                notify(f"READY=1\nSTATUS=routing on port {self.cfg.port} with {len(self.members)} processes")
            if all_up:
                watchdog.maybe_ping()
            time.sleep(0.05)
        return 0

    def _exited(self, m: _Member, rc: int | None, now: float) -> bool:
        """Child ``m`` exited with ``rc`` (or its restart was refused for a stale build without starting it: the
        refusal its start would print, exit 75): count a failed start, schedule the restart (module docstring) and
        log it. True: give up (:meth:`_give_up`). While a stale build keeps refusing it, the parent checks the build
        itself before each retry, and one line is logged at most every :data:`dplb.native.STALE_RETRY_LOG_S`."""
        if not m.listening:
            m.failures += 1
            if m.failures >= MAX_START_FAILURES and self._give_up(m, rc):
                return True
        if now - m.started_at > STABLE_S and not m.stale:
            m.backoff_s = BACKOFF_START_S
            m.next_start = now
        else:
            m.next_start = now + m.backoff_s
            m.backoff_s = min(BACKOFF_MAX_S, m.backoff_s * 2)
        after = "" if m.next_start <= now else f" in {m.next_start - now:.1f} s"
        if rc != StaleBuildError.exit_code:
            log.warning("router process %d exited (%s); restarting%s", m.index, _exit_text(rc), after)
        elif now >= m.stale_log_at:
            log.warning("router process %d %s (exit %d: the compiled build went stale; %s); restarting%s, this line "
                        "at most every %.0f s until it starts", m.index, "refused" if m.stale else "exited",
                        rc, native.FIXES, after, native.STALE_RETRY_LOG_S)
            m.stale_log_at = now + native.STALE_RETRY_LOG_S
        m.stale = rc == StaleBuildError.exit_code
        return False

    def _give_up(self, m: _Member, rc: int | None) -> bool:
        """After :data:`MAX_START_FAILURES` failed starts in a row: give up (True) only when no sibling serves;
        while one does, stopping the group would turn one missing process into an outage, so keep restarting this
        one at the longest backoff (logged once; ``dplb_router_processes`` shows it missing)."""
        serving = [o.index for o in self.members if o is not m and o.listening and o.proc is not None]
        if not serving:
            log.error("router process %d failed to start %d times in a row (exit %s) and no other process serves; "
                      "giving up", m.index, m.failures, rc)
            return True
        if m.failures == MAX_START_FAILURES:
            log.error("router process %d failed to start %d times in a row (exit %s); processes %s still serve, "
                      "retrying every %.0f s", m.index, m.failures, rc, ",".join(map(str, serving)), BACKOFF_MAX_S)
        m.backoff_s = BACKOFF_MAX_S
        return False

    def _stop(self) -> int:
        """SIGTERM every child, wait up to :func:`stop_wait_s`, SIGKILL the rest. 1 if any did not exit 0."""
        notify("STOPPING=1")
        procs = [m.proc for m in self.members if m.proc is not None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        wait_s = stop_wait_s(self.cfg.drain_notice_s)
        deadline = time.monotonic() + wait_s
        bad = False
        for p in procs:
            try:
                rc = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("router process pid %d did not stop within %.0f s; killing it", p.pid, wait_s)
                p.kill()
                rc = p.wait()
            bad |= rc != 0
        return 1 if bad else 0


def stop_wait_s(drain_notice_s: float) -> float:
    """How long a stopping router (a group's parent for its children) may take after SIGTERM: the drain notice it
    still serves (``--drain-notice``), then :data:`STOP_TIMEOUT_S`."""
    return drain_notice_s + STOP_TIMEOUT_S


def _exit_text(rc: int | None) -> str:
    if rc is None:
        return "exit status unknown"
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"


def run_group(cfg: RouterConfig, log_level: str = "info") -> int:
    """Run ``cfg.processes`` router processes under this one (module docstring). Returns the exit code."""
    group = RouterGroup(cfg, log_level)
    return group.run()
