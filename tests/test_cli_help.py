"""What a new user reads: help texts that state limits and defaults, ``--help-engine``, ``--emit-systemd``
output, ``dplb state --watch`` into a file, and no sim-internal header reaching a client."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cluster import ROOT as _ROOT
from cluster import cluster, dplb_cmd, free_port, launched

from dplb.errors import ConfigError
from dplb.ops.checks import check_scrape_host, loopback_targets
from dplb.ops.state_cli import render_table, snapshot


def _help(*args: str) -> str:
    r = subprocess.run(dplb_cmd(*args, "--help"), capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())


def test_help_texts_state_limits_and_defaults() -> None:
    launch = _help("launch")
    for needle in ("1..64", "32 MiB", "to connect to a worker's socket", "on stop (default 30)",
                   "becoming ready (default 3)", "--metrics-host", "default 30001+K"):
        assert needle in launch, needle
    router = _help("router")  # every timeout and policy knob says its default, from the config it fills
    for needle in ("response head (default 600)", "mid-response (default 120)", "next worker (default 5)",
                   "plain queue; default: 1.0)", "last 10 requests (default: e2e)",
                   "--router-restart-after S, --restart-after S", "(default 15, the router unit's WatchdogSec)"):
        assert needle in router and needle in launch, needle
    run, compare = _help("bench", "run"), _help("bench", "compare")
    for bench in (run, compare):  # a default said once, never "(default: None)"
        assert "(default: None)" not in bench and not re.search(r"\(default[^)]*\) \(default", bench), bench
    assert "requests to send (default: 200)" in run and "sim workers per cluster (default: 4)" in compare
    worker = _help("worker")
    assert "--help-engine {sim,vllm}" in worker and "--metrics-host" in worker


def test_help_engine_sim_lists_every_sim_knob() -> None:
    r = subprocess.run(dplb_cmd("worker", "--help-engine", "sim"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for knob in ("--sim-max-num-seqs", "--sim-speed", "--sim-warmup-delay-s", "--sim-oom-after"):
        assert knob in r.stdout, knob
    r = subprocess.run(dplb_cmd("worker", "--worker-id", "0", "--uds", "/tmp/x.sock", "--sim-bogus", "1"),
                       capture_output=True, text=True, timeout=60, env={**os.environ, "DPLB_SHM_PATH": "/nonexistent"})
    assert r.returncode == 2 and "`dplb worker --help-engine sim`" in r.stderr, r.stderr  # advertised, and it exists


def test_help_engine_sim_describes_every_knob() -> None:
    """Regression: every knob's help was only its default. Now each flag says what it does (from SimConfig's
    docstring, where the knobs are declared) before its default, and the docstring describes every knob."""
    import dataclasses

    from dplb.worker.engines import knob_help, sim_arg_parser
    from dplb.worker.engines.sim.scheduler import SimConfig

    helps = knob_help(SimConfig.__doc__ or "")
    assert set(helps) == {f.name for f in dataclasses.fields(SimConfig)}
    for a in sim_arg_parser()._actions:
        assert a.help and re.fullmatch(r"\S.{8,} \(default .+\)", a.help), (a.option_strings, a.help)
    assert helps["block_size"] == "tokens per block" and helps["kv_blocks"] == "KV cache capacity in blocks"
    assert helps["warmup_delay_s"] == "SimEngine.start sleeps this long (a slow cold start)"
    r = subprocess.run(dplb_cmd("worker", "--help-engine", "sim"), capture_output=True, text=True, timeout=60)
    text = " ".join(r.stdout.split())
    assert "--sim-crash-after CRASH_AFTER after N completed requests the process exits with os._exit(1) (default 0)" \
        in text, r.stdout


def test_emit_systemd_enables_the_target_and_writes_scrape_targets(tmp_path: Path) -> None:
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--host", "10.0.0.5", "--port", "31000",
                                "--metrics-host", "0.0.0.0", "--metrics-port-base", "32001", "--emit-systemd",
                                str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "systemctl enable --now dplb.target " in r.stdout, r.stdout
    groups = json.loads((tmp_path / "prometheus-targets.json").read_text())
    stack = f"{socket.gethostname()}:31000"  # the default stack label, on the router's and the workers' targets
    assert groups[0] == {"targets": ["10.0.0.5:31000"], "labels": {"job": "dplb-router", "stack": stack}}
    host = groups[1]["targets"][0].rsplit(":", 1)[0]
    assert host not in ("0.0.0.0", "") and groups[1]["targets"] == [f"{host}:32001", f"{host}:32002"]
    assert groups[1]["labels"] == {"job": "dplb-workers", "stack": stack}
    assert f'stack="{stack}"' in r.stdout, r.stdout
    # the workers bind what the targets file says
    for k in range(2):
        env = (tmp_path / f"worker-{k}.env").read_text()
        assert f"--metrics-host 0.0.0.0 --metrics-port {32001 + k}\n" in env, env


def test_a_wildcard_metrics_host_whose_fqdn_is_loopback_is_warned_about_and_scrape_host_names_it() -> None:
    """Regression: ``--metrics-host 0.0.0.0`` wrote ``localhost:PORT`` targets (``socket.getfqdn()`` is
    ``localhost`` where /etc/hosts maps the host name to 127.0.0.1) without a word. The decision, by the FQDN."""
    warn = loopback_targets("0.0.0.0", "0.0.0.0", True, None, fqdn="localhost")
    assert warn is not None and "--host 0.0.0.0 and --metrics-host 0.0.0.0 name this host 'localhost'" in warn
    assert "loopback (127.0.0.1" in warn and "--scrape-host" in warn and "\n" not in warn, warn
    assert "does not resolve" in (loopback_targets("127.0.0.1", "::", True, None, fqdn="x.invalid") or "")
    assert loopback_targets("0.0.0.0", "0.0.0.0", True, None, fqdn="10.0.0.5") is None  # reachable: quiet
    assert loopback_targets("0.0.0.0", "0.0.0.0", True, "10.0.0.5", fqdn="localhost") is None  # named: quiet
    assert loopback_targets("0.0.0.0", "0.0.0.0", True, "x.invalid", fqdn="localhost") is None  # Prometheus's DNS
    for loop in ("127.0.0.1", "::1", "localhost"):  # a loopback --scrape-host: the same warning as a loopback FQDN
        warn = loopback_targets("0.0.0.0", "0.0.0.0", True, loop, fqdn="10.0.0.5")
        assert warn is not None and f"name this host {loop!r} (--scrape-host), which resolves only to loopback" \
            in warn, warn
    # loopback worker metrics (the default) or none: the file is a local Prometheus's anyway
    assert loopback_targets("0.0.0.0", "127.0.0.1", True, None, fqdn="localhost") is None
    assert loopback_targets("0.0.0.0", "0.0.0.0", False, None, fqdn="localhost") is None
    for ok in ("10.0.0.5", "fe80::1", "gpu-node-3.example.com", "gpu-node-3"):
        assert check_scrape_host(ok, "0.0.0.0", "127.0.0.1", True) == ok
    # an IPv6 address bracketed as in a URL is taken (the targets bracket it themselves), never called "a port"
    assert check_scrape_host("[::1]", "0.0.0.0", "127.0.0.1", True) == "::1"
    for bad, says in (("a:1", "without a port"), ("http://h", "without a port"), ("-h", "without a port"),
                      ("a b", "without a port"), ("h", "none is one"), ("[10.0.0.5]", "only an IPv6 address"),
                      ("[h]", "not an IPv6 address"), ("[::1]:9090", "without a port")):
        with pytest.raises(ConfigError, match=says):
            check_scrape_host(bad, "127.0.0.1" if bad == "h" else "0.0.0.0", "127.0.0.1", True)


def test_emit_systemd_writes_the_scrape_host_for_wildcard_binds_and_warns_without_it(tmp_path: Path) -> None:
    def emit(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--metrics-host", "0.0.0.0", *args,
                                       "--emit-systemd", str(out)), capture_output=True, text=True, timeout=60)

    r = emit(tmp_path / "a", "--scrape-host", "10.0.0.9")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    groups = json.loads((tmp_path / "a" / "prometheus-targets.json").read_text())
    assert [g["targets"] for g in groups] == [["10.0.0.9:30000"], ["10.0.0.9:30001", "10.0.0.9:30002"]]
    r = emit(tmp_path / "b")
    warn = loopback_targets("0.0.0.0", "0.0.0.0", True, None)  # this host's FQDN decides (loopback on the CI box)
    assert r.returncode == 0 and (f"warning: {warn}" in r.stderr if warn else "warning" not in r.stderr), r.stderr
    r = emit(tmp_path / "d", "--scrape-host", "[::1]")
    assert r.returncode == 0 and "name this host '::1' (--scrape-host), which resolves only to loopback" in r.stderr
    groups = json.loads((tmp_path / "d" / "prometheus-targets.json").read_text())
    assert [g["targets"] for g in groups] == [["[::1]:30000"], ["[::1]:30001", "[::1]:30002"]]
    r = emit(tmp_path / "c", "--scrape-host", "10.0.0.9:9090")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith("got '10.0.0.9:9090'"), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "c").exists()


def test_launch_writes_the_scrape_host_and_warns_about_a_loopback_fqdn(tmp_path: Path) -> None:
    """``dplb launch`` itself (not only ``--emit-systemd``): the targets file and the one-line warning."""
    mport = free_port()
    with launched(tmp_path, "--num-workers", "1", "--metrics-host", "0.0.0.0", "--metrics-port-base", str(mport),
                  "--scrape-host", "10.0.0.9", tag="scrape") as ln:
        ln.wait_ready(60)
        groups = json.loads((Path(ln.run_dir) / "prometheus-targets.json").read_text())
        assert groups[1]["targets"] == [f"10.0.0.9:{mport}"], groups
        assert groups[0]["targets"][0].startswith("127.0.0.1:"), groups  # a specific --host is written as is
        assert "warning" not in ln.log.read_text()
    warn = loopback_targets("127.0.0.1", "0.0.0.0", True, None)
    with launched(tmp_path, "--num-workers", "1", "--metrics-host", "0.0.0.0", "--metrics-port-base", str(mport),
                  tag="noscrape") as ln:
        ln.wait_ready(60)
        groups = json.loads((Path(ln.run_dir) / "prometheus-targets.json").read_text())
        assert groups[1]["targets"] == [f"{socket.getfqdn()}:{mport}"], groups
        log = ln.log.read_text()
        assert (f"DPLB: warning: {warn}\n" in log) if warn else "warning" not in log, log


def test_emit_systemd_labels_a_localhost_router_and_127_0_0_1_workers_as_one_stack(tmp_path: Path) -> None:
    """The router target ``localhost:P`` and the worker targets ``127.0.0.1:…`` share no host, only the stack label
    (--stack-name) the dashboards select by; a name that cannot go into a PromQL string is refused, nothing written."""
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--host", "localhost", "--stack-name",
                                "gpu-node-3.prod:a", "--emit-systemd", str(tmp_path)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    groups = json.loads((tmp_path / "prometheus-targets.json").read_text())
    assert [g["targets"] for g in groups] == [["localhost:30000"], ["127.0.0.1:30001", "127.0.0.1:30002"]]
    assert [g["labels"] for g in groups] == [{"job": "dplb-router", "stack": "gpu-node-3.prod:a"},
                                             {"job": "dplb-workers", "stack": "gpu-node-3.prod:a"}]
    for bad in ('a"b', "", "two words", "-x", "x" * 129):
        out = tmp_path / f"bad{len(bad)}"
        r = subprocess.run(dplb_cmd("launch", "--num-workers", "1", "--stack-name", bad, "--emit-systemd", str(out)),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--stack-name" in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)
        assert not out.exists(), bad


def test_state_watch_into_a_file_writes_frames_and_the_heading_does_not_wrap(tmp_path: Path) -> None:
    from rich.console import Console

    with cluster(str(tmp_path), 1) as c:
        out = tmp_path / "watch.txt"
        with open(out, "w") as f:
            p = subprocess.Popen(dplb_cmd("state", "--watch", "--interval", "0.2"), stdout=f,
                                 stderr=subprocess.PIPE, env=c.env())
            time.sleep(3)
            p.send_signal(signal.SIGTERM)  # what `timeout 3 dplb state --watch > f` does
            _, err = p.communicate(timeout=20)
        assert p.returncode == 0, err
        text = out.read_text()
        assert text.count(c.shm_path) >= 3 and text.count("ready") >= 3, text  # one frame per interval, flushed
        assert c.segment is not None
        console = Console(width=120, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
        console.print(render_table(snapshot(c.segment)))
        first = console.export_text().splitlines()[0]
        assert c.shm_path in first and "interval=200 ms" in first and "routers(pid:port)=" in first, first
        narrow = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115 (a pipe's width)
        snap = snapshot(c.segment)
        table = render_table(snap)
        narrow.print(table)
        flat = " ".join(narrow.export_text().split())  # wrapped at 80 columns, never cut
        heading, cpus = (" ".join(r.plain.split()) for r in table.renderables[:2])  # type: ignore[attr-defined]
        assert len(heading) > 80 and heading in flat and cpus in flat and "routers(pid:port)=" in flat, flat


def test_state_says_stale_for_a_frozen_worker_and_the_legend_explains_it(tmp_path: Path) -> None:
    """Regression: a SIGSTOPped worker showed as ``ready!`` (the docs say ``stale``; the legend did not explain
    ``!``). The row now says ``stale``, the legend says what it means, and ``--json`` keeps the lifecycle."""
    with cluster(str(tmp_path), 2) as c:
        c.kill_worker(0, signal.SIGSTOP)
        try:
            time.sleep(1.0)  # > 3 x 200 ms: stale
            r = subprocess.run(dplb_cmd("state"), capture_output=True, text=True, timeout=60, env=c.env())
            js = json.loads(subprocess.run(dplb_cmd("state", "--json"), capture_output=True, text=True, timeout=60,
                                           env=c.env()).stdout)
        finally:
            c.kill_worker(0, signal.SIGCONT)
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln.split()[2] for ln in r.stdout.splitlines() if re.match(r"\s*[01] +\d+ ", ln)}
    assert rows == {"0": "stale", "1": "ready"}, r.stdout
    assert "!" not in r.stdout, r.stdout
    assert r.stdout.splitlines()[-1].startswith("state stale: no heartbeat for 3 intervals"), r.stdout
    w0 = js["workers"][0]
    assert (w0["lifecycle"], w0["stale"], w0["why"]) == ("ready", True, "stale"), w0


def test_sim_internal_header_never_reaches_a_client(tmp_path: Path) -> None:
    with cluster(str(tmp_path), 1) as c:
        for stream in (False, True):
            r = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "a b", "max_tokens": 2,
                                                            "stream": stream}, timeout=30)
            assert r.status_code == 200 and not [h for h in r.headers if h.lower().startswith("x-sim-")], r.headers
        r = httpx.post(c.url + "/v1/completions", content=b"{bad", timeout=30,
                       headers={"content-type": "application/json"})
        assert not [h for h in r.headers if h.lower().startswith("x-sim-")], r.headers
        # the whole kind: every other endpoint the sim serves (regression: its extra endpoints sent it always)
        for path, body in (("/tokenize", {"model": "dplb-sim", "prompt": "a b"}),
                           ("/v1/responses", {"model": "dplb-sim", "input": "hi", "max_output_tokens": 2}),
                           ("/v1/embeddings", {"model": "dplb-sim", "input": "a b"}),
                           ("/v1/rerank", {"model": "dplb-sim", "query": "a", "documents": ["a", "b"]})):
            r = httpx.post(c.url + path, json=body, timeout=30)
            assert r.status_code < 500 and not [h for h in r.headers if h.lower().startswith("x-sim-")], \
                (path, r.status_code, r.headers)


ROOT = Path(_ROOT)
SCRIPTS = sorted(str(p.relative_to(ROOT)) for d in ("scripts", "benchmarks") for p in (ROOT / d).glob("*.py")
                 if "__main__" in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_and_writes_nothing(script: str) -> None:
    """``--help`` on each runnable script of scripts/ and benchmarks/: exit 0 with a usage line, and no file of the
    repository changed (a script that ignored its flags rewrote the rules and runbooks on ``--help``)."""
    before = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    r = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage:" in r.stdout, (r.stdout[-500:], r.stderr[-1500:])
    after = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    assert after == before, (before, after)
