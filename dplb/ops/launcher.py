"""``dplb launch``: plan GPUs, create the segment, start and supervise workers and the router (docs/DESIGN.md §10).

Contract
- Plan with :func:`dplb.ops.plan.plan_gpus` (GPUs from NVML; none → CPU workers). Without ``--model`` the sim engine
  runs, and the launcher says so loudly; with ``--model`` the vLLM engine runs, and if it cannot start that is an
  error (exit non-zero), never a silent fall-back to the sim.
- Creates the segment (``/dev/shm/dplb_state_<unix seconds>_<pid>`` unless ``--shm-path``) and a private run
  directory (0700) for sockets and logs (default :func:`dplb.stack.stack_run_dir` of ``--port``; the metrics ports
  follow ``--port`` too, :func:`dplb.stack.stack_metrics_port_base`: a second stack is one flag), exports
  ``DPLB_SHM_PATH``, starts each worker with ``CUDA_VISIBLE_DEVICES`` for its group, then the router; prints the
  URL, a curl example and where the logs are.
- Supervision: a worker or router that exits unexpectedly is restarted with exponential backoff (1 s doubling to
  30 s; reset after 60 s of uptime), after what it left in its process group is killed (a vLLM worker's
  ``EngineCore`` outlives a SIGKILLed worker). A worker whose engine stays stalled ``--stall-restart-after`` seconds
  exits by itself (:mod:`dplb.worker.process`) and is restarted the same way; one that publishes nothing that long
  while its process lives (SIGSTOPped, its collector wedged) is killed (its process group) and restarted, and so is
  a single-process router whose router slot's heartbeat is ``--router-restart-after`` seconds old (logged; restarts
  counted in the log). A ``--router-processes`` group's children are judged by the same value by the group's parent
  (:mod:`dplb.router.supervisor`, which gets it in the router configuration and restarts the child it kills), not
  by the launcher: one judge per process; the launcher judges the group as a whole by its children (a parent
  that lives while none of its children has published a heartbeat that long, plus a grace for the parent's own
  restarts, is stopped or wedged: :func:`dplb.ops.watchdog.kill_if_group_unserved`) and restarts it as one router.
  A worker or router that fails before ever becoming ready ``--max-start-failures`` times in a row stops the launch
  with its log tail, except a router start refused because
  the compiled build went stale (:class:`dplb.errors.StaleBuildError`'s exit status, which a ``--router-processes``
  group's parent passes on when its children refuse): the workers are kept, one ERROR names the fix, and the router
  is retried (waits capped at 5 s; one ``router restarted`` line, then at most one a minute) until a rebuild (or
  ``--clean``) lets it start.
- The segment is followed (:class:`dplb.state.follow.SegmentFollower`): removed (a cleanup), its mapping is dropped
  and the frozen-worker watchdog is off (it never judges heartbeats that stopped because the workers lost the
  file); recreated at the same path (``dplb segment create``, the runbook's mitigation), the new file is mapped,
  the header fields it lacks (model, GPU map, run dir) are restored, and the watchdog judges the new slots (a worker
  ready before that has re-published nothing into it ``--stall-restart-after`` seconds later is frozen too). One
  WARNING line when it goes, one INFO line when it is back.
- A worker's engine killed (its process group reaped after the worker exited) leaves ``/dev/shm/psm_*`` files:
  those its processes were seen mapping are removed once no process has them open or mapped
  (:mod:`dplb.ops.shm_leftovers`).
- Ctrl-C / SIGTERM: SIGTERM to every worker (they drain) and the router, wait up to the drain timeout, SIGKILL what
  is left (each child's process group too), then remove the sockets, the segment and the run directory it created.
  Nothing is left in /dev/shm.
- The launcher itself SIGKILLed: its children's parent-death SIGTERM stops them as a SIGTERM of the launcher would
  (the router's drain notice with the workers serving; :mod:`dplb.worker.process`) and the last of them removes the
  segment (:func:`dplb.state.segments.remove_abandoned`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

from dplb import native
from dplb.errors import ConfigError, StaleBuildError
from dplb.ops.checks import (
    check_launch_flags,
    check_model,
    check_ports,
    check_socket_paths,
    child_argv,
    loopback_targets,
    parse_worker_args,
    root_cause,
    scrape_targets,
    write_scrape_targets,
)
from dplb.ops.children import BACKOFF_MAX_S, BACKOFF_START_S, Child
from dplb.ops.doctor import check_run_dir
from dplb.ops.placement import host_placement
from dplb.ops.plan import cuda_visible_devices, plan_gpus
from dplb.ops.shm_leftovers import ShmLeftovers
from dplb.ops.watchdog import kill_if_group_unserved, kill_if_router_frozen, kill_if_worker_frozen
from dplb.router.cli import router_config
from dplb.router.supervisor import child_env
from dplb.runtime.gpu import discover_gpus, visible_gpu_indices
from dplb.stack import stack_run_dir, worker_metrics_ports
from dplb.state.follow import SegmentFollower
from dplb.state.segments import check_takeover, inspect
from dplb.state.shm import ENV_SHM_PATH, Lifecycle, Segment, default_segment_path
from dplb.worker.engines import sim_config

log = logging.getLogger("dplb.launch")
STABLE_S = 60.0  # a child up this long has its restart backoff reset
ROUTER_RETRY_MAX_S = 5.0  # the longest wait before a router restart (the router is the stack's one way in)
SHUTDOWN_SWEEP_S = 3.0  # at stop, how long leftover engine shared memory is waited for (the killed processes exit)


def try_line(url: str, model: str, api_key: str | None, tenants_file: str | None, env_key: str | None) -> str:
    """The banner's ``try:`` line: a curl of one chat completion that works when pasted. The key is never
    printed: the line reads ``$DPLB_API_KEY`` (with a note when that is not the key given) or, with a tenants file
    and no ``--api-key``, ``$KEY`` (a tenant's key: without one the router answers 401)."""
    auth, note = "", ""
    if api_key:
        auth = '-H "Authorization: Bearer $DPLB_API_KEY" '
        if env_key != api_key:
            note = "\n           (export DPLB_API_KEY=<the key> in that shell first)"
    elif tenants_file:
        auth = '-H "Authorization: Bearer $KEY" '
        note = f"\n           (KEY: a key of a tenant in {tenants_file}; any other key gets 401)"
    return (f"  try:     curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' {auth}"
            f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
            f"\"max_tokens\": 16}}'{note}")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


_dplb = child_argv


class Launcher:
    """Runs the whole stack in the foreground until a signal."""

    def __init__(self, args: argparse.Namespace, engine_args: list[str]) -> None:
        self.args = args
        self.engine_args = engine_args
        gpus = visible_gpu_indices()
        if gpus is None:
            gpus = [g.index for g in discover_gpus()]
        self.plan = plan_gpus(gpus, args.num_workers, args.tensor_parallel_size)
        self.engine = "vllm" if args.model else "sim"
        self.placement = host_placement(args, self.plan, self.engine)
        if not gpus and args.tensor_parallel_size > 1:
            raise ConfigError(f"--tensor-parallel-size {args.tensor_parallel_size} needs GPUs, and none is visible")
        mbase = check_launch_flags(args, len(self.plan))
        self.per_worker_args = parse_worker_args(args.worker_args or [], len(self.plan))
        if self.engine == "sim":  # each worker's --sim-* arguments, checked before anything starts
            for k in range(len(self.plan)):
                sim_config(engine_args + self.per_worker_args.get(k, []), model=args.served_model_name)
        self.run_dir = args.run_dir or stack_run_dir(args.port)
        # Same resolution as `dplb state`: --shm-path, else $DPLB_SHM_PATH, else a new default path.
        self.shm_path = args.shm_path or os.environ.get(ENV_SHM_PATH) or default_segment_path()
        self.metrics_ports = worker_metrics_ports(mbase, len(self.plan))
        self.stopping = False
        self.targets_path = ""
        self.created_run_dir = False
        self.segment: SegmentFollower | None = None
        self.workers: list[Child] = []
        self.router: Child | None = None
        # Validate the router flags now (same checks the router does), before starting anything.
        self.router_cfg = router_config(args, run_dir=self.run_dir, shm_path=self.shm_path,
                                        num_workers=len(self.plan), state_interval_ms=args.state_interval_ms)

    # ---- start ---------------------------------------------------------------------------------------------
    def preflight(self) -> None:
        """Refuse to start next to a running deployment or on a path DPLB must not touch: every port the stack binds
        (router, agent-check, workers' metrics) must be free, the run dir usable and its sockets unserved (`dplb
        doctor`'s ``run_dir`` check), ``--model`` a model, and the segment path missing or a stale DPLB segment.
        Raises :class:`ConfigError`/:class:`ShmError` naming the problem and the flag to change (nothing has been
        started or touched yet)."""
        check_model(self.args.model)
        check_takeover(self.shm_path)
        check_ports(self.args.host, self.args.port, self.args.metrics_host, self.metrics_ports,
                    self.router_cfg.agent_port)
        run_dir = check_run_dir(self.run_dir)  # `dplb doctor`'s run_dir check: the two cannot disagree
        if run_dir.status == "fail":
            raise ConfigError(f"{run_dir.detail}; {run_dir.fix}")
        check_socket_paths([self.router_cfg.socket_path(k) for k in range(len(self.plan))])

    def _prepare(self) -> None:
        try:
            if not os.path.isdir(self.run_dir):
                os.makedirs(self.run_dir, mode=0o700)
                self.created_run_dir = True
            os.chmod(self.run_dir, 0o700)
        except OSError as e:
            raise ConfigError(f"cannot create the run directory {self.run_dir}: {e.strerror or e}; pass --run-dir "
                              "to a writable directory") from e
        model_name = self.args.served_model_name or self.args.model or "dplb-sim"
        try:
            seg = Segment.create(self.shm_path, len(self.plan), state_interval_ms=self.args.state_interval_ms,
                                 model=model_name, gpu_map=self.plan, run_dir=self.run_dir,
                                 replace=os.path.exists(self.shm_path))  # a stale DPLB segment (preflight)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self.segment = SegmentFollower(
            seg, who="launcher", log=log, min_workers=len(self.plan),
            while_missing="the frozen-worker watchdog is off (and a worker that restarts exits)",
            on_attach=lambda new: _restored(new.restore_header(model_name, self.plan, self.run_dir)))
        env = {k: v for k, v in os.environ.items() if k != "DPLB_API_KEY"}
        env[ENV_SHM_PATH] = self.shm_path
        env["DPLB_RUN_DIR"] = self.run_dir
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA and NVML agree on indices
        for k, group in enumerate(self.plan):
            wenv = dict(env)
            wenv.update(self.placement.worker_env(k))
            if group:
                wenv["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(group)
            argv = _dplb("--log-level", self.args.log_level, "worker", "--worker-id", str(k), "--engine",
                         self.engine, "--uds", self.router_cfg.socket_path(k),
                         "--drain-timeout", str(self.args.drain_timeout),
                         "--stall-after", f"{self.router_cfg.stall_after_s:g}",
                         "--stall-restart-after", f"{self.args.stall_restart_after:g}",
                         "--prefix-block-bytes", str(self.router_cfg.policy.prefix_block_bytes))
            if self.args.model:
                argv += ["--model", self.args.model]
            if self.args.served_model_name:
                argv += (["--model", self.args.served_model_name] if self.engine == "sim"
                         else ["--served-model-name", self.args.served_model_name])
            argv += ["--metrics-port", str(self.metrics_ports[k] if self.metrics_ports else 0),
                     "--metrics-host", self.args.metrics_host]
            if self.engine == "vllm" and len(group) > 1:
                argv += ["--tensor-parallel-size", str(len(group))]
            argv += self.engine_args + self.per_worker_args.get(k, [])
            self.workers.append(Child(f"worker {k}", argv, wenv, os.path.join(self.run_dir, f"worker-{k}.log"),
                                      cpus=self.placement.workers[k], shm=ShmLeftovers(f"worker {k}")))
        # The router gets its validated configuration whole (JSON in $DPLB_ROUTER_CONFIG), not re-emitted flags.
        rargv = _dplb("--log-level", self.args.log_level, "router", "--config-env")
        renv = child_env(self.router_cfg, env)
        self.router = Child("router", rargv, renv, os.path.join(self.run_dir, "router.log"),
                            cpus=self.placement.router)

    def _local_url(self) -> str:
        host = "127.0.0.1" if self.args.host in ("0.0.0.0", "::", "") else self.args.host
        return f"http://{host}:{self.args.port}"

    def _banner(self) -> None:
        url = self._local_url()
        if self.engine == "sim":
            print("=" * 78, file=sys.stderr)
            print("  No --model given: running the SIM engine (a simulated vLLM on the CPU).", file=sys.stderr)
            print("  Pass --model PATH_OR_NAME to serve a real model with vLLM.", file=sys.stderr)
            print("=" * 78, file=sys.stderr)
        plan = ", ".join(f"worker {k}: {('GPUs ' + cuda_visible_devices(g)) if g else 'CPU'}"
                         for k, g in enumerate(self.plan))
        model = self.args.served_model_name or self.args.model or "dplb-sim"
        print(f"DPLB: {len(self.plan)} {self.engine} worker(s) [{plan}]\n"
              f"  router:  {url}  (policy {self.args.policy}; listening on {self.args.host}:{self.args.port}"
              f"{', all interfaces' if self.args.host in ('0.0.0.0', '::') else ''}"
              f"{', API key required' if self.args.api_key else ''})\n"
              + "".join(f"  {'cpus:' if i == 0 else '':9}{line}\n" for i, line in enumerate(self.placement.describe()))
              + f"  segment: {self.shm_path}   (dplb state --shm-path {self.shm_path})\n"
              f"  build:   {native.describe()}\n"
              f"  logs:    {self.run_dir}/worker-K.log, {self.run_dir}/router.log (kept after exit)\n"
              f"  scrape:  {self.targets_path} (Prometheus file_sd: jobs dplb-router, dplb-workers; "
              f"stack=\"{self.args.stack_name}\")\n"
              + try_line(url, model, self.args.api_key, getattr(self.args, "tenants", None),
                         os.environ.get("DPLB_API_KEY")), file=sys.stderr, flush=True)

    # ---- run -----------------------------------------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        # SIGUSR1: the router reports drain to the front balancer (Kubernetes preStop: kill -USR1 1).
        signal.signal(signal.SIGUSR1, lambda signum, frame: self.router.signal(signal.SIGUSR1) if self.router else None)
        signal.signal(signal.SIGHUP, lambda signum, frame: self.router.signal(signal.SIGHUP) if self.router else None)
        self.preflight()
        try:
            self._prepare()
            a = self.args
            self.targets_path = write_scrape_targets(self.run_dir, scrape_targets(
                a.host, a.port, a.metrics_host, self.metrics_ports, a.stack_name, a.scrape_host))
            self._banner()
            unreachable = loopback_targets(a.host, a.metrics_host, bool(self.metrics_ports), a.scrape_host)
            if unreachable:
                print(f"DPLB: warning: {unreachable}", file=sys.stderr, flush=True)
            for w in self.workers:
                w.start()
            assert self.router is not None
            self.router.start()
            return self._supervise()
        finally:
            self._shutdown()

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.stopping:
            print(f"\nDPLB: {signal.Signals(signum).name} received, draining workers…", file=sys.stderr, flush=True)
        self.stopping = True

    def _supervise(self) -> int:
        announced = False
        assert self.segment is not None and self.router is not None
        while not self.stopping:
            now = time.monotonic()
            seg = self.segment.current()  # None while the segment is missing: nothing is judged on it
            for k, w in enumerate(self.workers):
                if seg is not None and not w.ever_ready and w.proc is not None:
                    s = seg.read(k)
                    if s.lifecycle == Lifecycle.READY and s.pid == w.proc.pid:  # this process's own slot
                        w.ever_ready = True
                        w.start_failures = 0
                if w.shm is not None and w.shm.pending:
                    w.shm.sweep()  # what a killed engine left in /dev/shm, once nothing uses it
                if w.alive() or self.stopping:
                    w.watch()
                    if seg is not None and w.ever_ready and not self.stopping:
                        kill_if_worker_frozen(seg, k, w, self.args.stall_restart_after, self.segment.attached_at)
                    continue
                if w.next_start == 0.0:  # just exited: schedule a restart
                    w.reap()
                    rc = w.proc.returncode if w.proc else None
                    if self._gives_up(w, rc):
                        return 1
                    if now - w.started_at > STABLE_S:
                        w.backoff_s = BACKOFF_START_S
                    log.warning("%s %s; restarting in %.0f s (log: %s)", w.name, _exit_text(rc), w.backoff_s,
                                w.log_path)
                    w.next_start = now + w.backoff_s
                    w.backoff_s = min(BACKOFF_MAX_S, w.backoff_s * 2)
                elif now >= w.next_start:
                    w.next_start = 0.0
                    w.restarts += 1
                    w.ever_ready = False
                    w.start()
                    log.info("%s restarted (restart #%d)", w.name, w.restarts)
            r = self.router
            if seg is not None and r.ever_ready and r.alive():
                if self.router_cfg.processes == 1:
                    kill_if_router_frozen(seg, r, self.router_cfg.restart_after_s)
                else:  # a group's parent judges its children; the launcher judges the group by them
                    kill_if_group_unserved(seg, r, self.router_cfg.restart_after_s, self.segment.attached_at)
            if not r.alive() and not self.stopping and not self._restart_router(r, now):
                return 1
            if not r.ever_ready and r.alive() and _http_ok(self._local_url() + "/health"):
                r.ever_ready = True
                r.start_failures = 0
                if r.extra.pop("stale_build", None):
                    log.info("router started: the build is current again")
            if not announced and r.ever_ready and all(w.ever_ready for w in self.workers):
                announced = True
                print(f"DPLB: all {len(self.workers)} worker(s) ready; serving on {self._local_url()}",
                      file=sys.stderr, flush=True)
            time.sleep(0.1)
        return 0

    def _restart_router(self, r: Child, now: float) -> bool:
        """The router exited: schedule its restart (backoff doubling, each wait capped at
        :data:`ROUTER_RETRY_MAX_S`), or start it when due. False: give up (:meth:`_gives_up`). A start refused
        because the compiled build is stale (:class:`StaleBuildError`'s exit status) never gives up: the workers
        keep running (a GPU worker takes minutes to start) and one ERROR names the fix; a rebuild heals the stack."""
        if r.next_start == 0.0:
            r.reap()
            rc = r.proc.returncode if r.proc else None
            if rc == StaleBuildError.exit_code:  # a single router at its start, or a group whose children refused
                if not r.extra.get("stale_build"):
                    r.extra["stale_build"] = True
                    r.extra["stale_log_at"] = 0.0
                    log.error("router restart refused: %s; the workers keep running and the router is retried "
                              "every %.0f s until then (log: %s)", _stale_line(r), ROUTER_RETRY_MAX_S, r.log_path)
            elif self._gives_up(r, rc):
                return False
            else:
                log.warning("router %s; restarting (log: %s)", _exit_text(rc), r.log_path)
            r.next_start = now + min(r.backoff_s, ROUTER_RETRY_MAX_S)
            r.backoff_s = min(BACKOFF_MAX_S, r.backoff_s * 2)
        elif now >= r.next_start:
            r.next_start = 0.0
            r.ever_ready = False
            r.restarts += 1
            r.start()
            self._log_router_restart(r, now)
        return True

    @staticmethod
    def _log_router_restart(r: Child, now: float) -> None:
        """``router restarted`` at INFO; while a stale build keeps refusing it (retried every
        :data:`ROUTER_RETRY_MAX_S`), the first retry and then at most one line per
        :data:`dplb.native.STALE_RETRY_LOG_S`."""
        if not r.extra.get("stale_build"):
            log.info("router restarted (restart #%d)", r.restarts)
            return
        due = r.extra.get("stale_log_at", 0.0)
        if isinstance(due, float) and now >= due:
            r.extra["stale_log_at"] = now + native.STALE_RETRY_LOG_S
            log.info("router restarted (restart #%d; refused for the stale build until it is rebuilt or cleaned, "
                     "retried every %.0f s, this line at most every %.0f s)", r.restarts, ROUTER_RETRY_MAX_S,
                     native.STALE_RETRY_LOG_S)

    def _gives_up(self, c: Child, rc: int | None) -> bool:
        """Count an exit before ``c`` ever became ready; True (after printing its log tail) once that happened
        ``--max-start-failures`` times in a row. An exit while the segment is missing is not counted: no worker can
        start then (the runbook's restart loop), and the stack must still be there when the segment is back."""
        if c.ever_ready or (self.segment is not None and self.segment.segment is None):
            return False
        c.start_failures += 1
        if c.start_failures < self.args.max_start_failures:
            return False
        tail = c.log_tail()
        cause = root_cause(c.log_tail(100_000))
        print(f"DPLB: {c.name} failed to start {c.start_failures} time(s) (exit {rc}); giving up.\n"
              + (f"Root cause: {cause}\n" if cause else "")
              + f"Last log lines ({c.log_path}):\n{tail}", file=sys.stderr)
        return True

    def _shutdown(self) -> None:
        self.stopping = True
        if self.router is None:  # nothing was started
            self._remove_segment()
            return
        notice = self.router_cfg.drain_notice_s
        if notice > 0 and self.router.alive():  # the host reports drain while still serving (dplb.router.host_report)
            self.router.signal(signal.SIGUSR1)
            print(f"DPLB: reporting drain to the front balancer for {notice:g} s before stopping…", file=sys.stderr,
                  flush=True)
            time.sleep(notice)
        for w in self.workers:
            w.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.drain_timeout + 5
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", w.name)
                w.signal(signal.SIGKILL)
                w.proc.wait(5)
            w.reap()
        _sweep(self.workers, SHUTDOWN_SWEEP_S)
        if self.router is not None:
            self.router.signal(signal.SIGTERM)
            if self.router.proc is not None:
                try:
                    self.router.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.router.signal(signal.SIGKILL)
                    self.router.proc.wait(5)
            self.router.reap()
        for k in range(len(self.plan)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.router_cfg.socket_path(k))
        seg_msg = self._remove_segment()
        if self.created_run_dir and self.args.remove_logs:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        print(f"DPLB: stopped; sockets removed, {seg_msg} (logs kept in {self.run_dir}).", file=sys.stderr,
              flush=True)

    def _remove_segment(self) -> str:
        """Remove the segment mapped now (ours, or the one that replaced it at our path: `dplb segment create` heals
        a deleted one), or a segment at our path that no live process uses; anything else is left. Returns what
        happened, for the stop message."""
        if self.segment is None:
            return "no segment"
        follower, self.segment = self.segment, None
        seg, path = follower.segment, follower.path
        follower.close()
        if seg is not None and seg.unlink():
            return f"segment {path}{' (recreated while running)' if follower.reattached else ''} removed"
        if not os.path.lexists(path):
            return f"segment {path} was already gone"
        info = inspect(path)
        if info.stale:
            os.unlink(path)
            return f"segment {path} (recreated while running) removed"
        return f"segment at {path} left in place (not ours: {info.describe()})"


def _sweep(workers: list[Child], within_s: float) -> None:
    """Remove what the workers' killed engines left in /dev/shm (:mod:`dplb.ops.shm_leftovers`), trying for up to
    ``within_s`` seconds while the killed processes go away."""
    deadline = time.monotonic() + within_s
    while True:
        pending = [w.shm for w in workers if w.shm is not None and w.shm.pending]
        for shm in pending:
            shm.sweep()
        if not pending or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _restored(fields: list[str]) -> str:
    """The launcher's note on a re-attached segment's header (:meth:`Segment.restore_header`)."""
    return f"restored its {', '.join(fields)}" if fields else ""


def _stale_line(r: Child) -> str:
    """The refusal's reason from the router's log: its last line naming the stale build (a group's parent logs
    its own lines after its children's refusals), else its last line."""
    tail = r.log_tail(20).splitlines()
    return next((ln.strip() for ln in reversed(tail) if "is stale" in ln), tail[-1].strip() if tail else "") \
        or "the build is stale"


def _exit_text(rc: int | None) -> str:
    """How a child ended, for the supervisor's log."""
    if rc == 0:
        return "exited cleanly (code 0: it was stopped, e.g. drained after a SIGTERM not sent by this launcher)"
    return f"exited unexpectedly (code {rc})"
