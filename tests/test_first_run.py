"""What a careless first user types: sloppy comma lists, an early Ctrl-C, engine flags the sim does not have,
and the packaging metadata. Each is refused with one line (or ends quietly) before anything starts."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from dplb.config import parse_weights, split_list
from dplb.errors import ConfigError
from tests.cluster import dplb_cmd, free_port

ROOT = Path(__file__).resolve().parent.parent

# (flag, value) pairs each list parser must refuse: a stray comma anywhere, or only commas/spaces.
SLOPPY = ["queue=1,", ",queue=1", "queue=0.5,,memory=0.5", " , ", "a, ,b"]


@pytest.mark.parametrize("text", SLOPPY)
def test_split_list_refuses_every_empty_item(text: str) -> None:
    with pytest.raises(ConfigError, match="empty item"):
        split_list(text, "--x")


@pytest.mark.parametrize(("text", "items"), [("a", ["a"]), ("a, b ,c", ["a", "b", "c"]), (" a ", ["a"])])
def test_split_list_keeps_good_lists(text: str, items: list[str]) -> None:
    assert split_list(text, "--x") == items


def test_split_list_empty_is_an_error_unless_allowed() -> None:
    assert split_list("  ", "--x", allow_empty=True) == []
    with pytest.raises(ConfigError, match="must not be empty"):
        split_list("", "--x")


# Every comma-list parser of the CLI, the router and the sim: (what, parser, a good value).
def _parsers() -> list[tuple[str, object, str]]:
    from dplb.bench.compare import parse_policies
    from dplb.ops.fleet import parse_hosts
    from dplb.router.cli import parse_exempt
    from dplb.router.fanout import parse_workers
    from dplb.worker.engines.sim.api import parse_adapters

    return [("--weights", parse_weights, "queue=1"), ("--api-key-exempt", parse_exempt, "/health"),
            ("?workers=", lambda t: parse_workers(t, 4), "0"), ("--sim-lora-adapters", parse_adapters, "a"),
            ("--policies", lambda t: parse_policies(t, []), "dplb"), ("--hosts", parse_hosts, "10.0.0.1:30000")]


@pytest.mark.parametrize("index", range(6), ids=["weights", "api-key-exempt", "workers", "lora-adapters",
                                                 "policies", "hosts"])
def test_every_list_flag_refuses_a_stray_comma(index: int) -> None:
    _, parse, good = _parsers()[index]
    parse(good)  # type: ignore[operator]  # the value itself is fine
    for bad in (good + ",", "," + good, good + ",," + good, good + ", "):
        with pytest.raises(ValueError):
            parse(bad)  # type: ignore[operator]


@pytest.mark.parametrize("flags", [["--weights", "queue=1,"], ["--cors-allowed-origins", "https://a.example,"],
                                   ["--api-key-exempt", "/health,,/metrics"]])
def test_launch_refuses_sloppy_lists_with_one_line(flags: list[str]) -> None:
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "1", *flags), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "empty item" in r.stderr, r.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--sim-bogus-flag"], "--sim-bogus-flag"),
    (["--max-model-len", "4096"], "--max-model-len → --sim-max-model-len"),
    (["--sim-speed", "fast"], "invalid float value"),
    (["--sim-max-num-seqs", "0"], "max_num_seqs"),
    (["--worker-args", "1=--sim-bogus-flag"], "--sim-bogus-flag"),
])
def test_launch_checks_sim_arguments_before_starting_anything(tmp_path: Path, args: list[str], says: str) -> None:
    """Regression: unknown or bad sim engine arguments failed only after ~7 s and 3 start attempts per worker."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--port", str(free_port()), "--run-dir", str(run_dir), *args),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert not run_dir.exists() and time.monotonic() - t0 < 30  # nothing was created or started


def _sigint_is_default(pid: int) -> bool:
    """True when process ``pid`` has SIGINT at its default action (neither caught nor ignored)."""
    fields = dict(ln.split(":\t", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in ln)
    bit = 1 << (signal.SIGINT - 1)
    return not (int(fields["SigCgt"], 16) & bit) and not (int(fields["SigIgn"], 16) & bit)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.1, 0.2, 0.3, 0.5])
def test_early_ctrl_c_prints_no_traceback(tmp_path: Path, delay_s: float) -> None:
    """Regression: Ctrl-C in the first 0.3 s of `dplb launch` printed a KeyboardInterrupt traceback. The signal is
    sent ``delay_s`` after dplb's own code took over SIGINT (seen in /proc; before that it is Python's start-up)."""
    p = subprocess.Popen([sys.executable, "-m", "dplb.cli", "launch", "--num-workers", "1", "--port", str(free_port()),
                          "--metrics-port-base", "0", "--run-dir", str(tmp_path / "run"), "--drain-timeout", "1",
                          "--shm-path", f"/dev/shm/dplb_state_ctrlc_{os.getpid()}_{int(delay_s * 1000)}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    # At exec, before Python's start-up installs its own SIGINT handler, SIGINT is at its default too: wait for
    # that handler first (if dplb already replaced it by then, the wait below returns at once).
    deadline = time.monotonic() + 10
    while _sigint_is_default(p.pid) and time.monotonic() < deadline:
        assert p.poll() is None
        time.sleep(0.001)
    deadline = time.monotonic() + 30
    while not _sigint_is_default(p.pid):
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.002)
    time.sleep(delay_s)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    text = err.decode()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert p.returncode in (-signal.SIGINT, 130, 0), (p.returncode, text)
    assert not Path(f"/dev/shm/dplb_state_ctrlc_{os.getpid()}_{int(delay_s * 1000)}").exists()


def test_pyproject_license_is_an_spdx_string() -> None:
    """Regression: the ``license = {text = …}`` table is deprecated by setuptools (PEP 639: an SPDX expression)."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in meta["build-system"]["requires"]  # the first setuptools that reads the string
    assert not any(c.startswith("License ::") for c in meta["project"].get("classifiers", []))


def test_state_into_a_pipe_keeps_the_whole_heading_at_80_columns(tmp_path: Path) -> None:
    """Regression: `dplb state | cat` cut the heading at 80 columns (rich's width without a terminal)."""
    from dplb.state.shm import Segment

    path = f"/dev/shm/dplb_state_{int(time.time())}_{os.getpid()}_a_rather_long_segment_name_for_the_test"
    seg = Segment.create(path, 2, state_interval_ms=200, model="a-model-with-a-long-served-name")
    try:
        r = subprocess.run(dplb_cmd("state", "--shm-path", path), capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "80"})
        assert r.returncode == 0, r.stderr
        head = r.stdout.splitlines()[0]
        assert len(head) > 80 and head.startswith(path) and head.rstrip().endswith("routers(pid:port)=-"), head
        # the legend is two left-aligned lines (a caption was wrapped at the table's width and centred)
        units, states = r.stdout.splitlines()[-2:]
        assert units.startswith("age, lat, TTFT, warm: seconds;"), r.stdout
        assert units.rstrip().endswith("rtr: in flight from the routers"), r.stdout
        assert states.startswith("state stale: no heartbeat") and states.rstrip().endswith("no engine progress"), \
            r.stdout
    finally:
        seg.close()
        os.unlink(path)


def test_dashboard_generator_without_the_venv_says_which_python_to_use() -> None:
    """Regression: ``python dashboards/generate.py`` outside the virtualenv died with an ImportError traceback."""
    r = subprocess.run([sys.executable, "-S", str(ROOT / "dashboards" / "generate.py"), "--check"],
                       capture_output=True, text=True, timeout=60)  # -S: no site-packages, so no grafanalib
    assert r.returncode == 2 and "Traceback" not in r.stderr and ".venv/bin/python" in r.stderr, r.stderr


# What an SRE mistypes outside `dplb launch`: each is one line on stderr naming the fix, never a traceback.
@pytest.mark.parametrize(("origin", "ok"), [
    ("*", True), ("https://app.example.com", True), ("http://localhost:3000", True), ("https://*.example.com", True),
    ("http://127.0.0.1:8080", True), ("http://[::1]:3000", True), ("not a url", False), ("https://a.example/", False),
    ("https://App.example.com", False), ("https://a.example:0", False), ("https://a.example:70000", False),
    ("null", False), ("a.example", False), ("https://a.example/path", False), ("https://u@a.example", False),
    (" https://a.example", False), ("https://a.example:443", False), ("http://a.example:80", False),
    ("https://a.example:80", True), ("http://a.example:443", True)])  # a browser omits the default port
def test_an_origin_is_what_a_browser_sends(origin: str, ok: bool) -> None:
    from dplb.http_values import is_origin

    assert is_origin(origin) is ok


@pytest.mark.parametrize("cmd", [["launch", "--num-workers", "1"], ["router", "--num-workers", "1", "--port", "1"]])
def test_a_cors_origin_that_is_not_an_origin_is_refused_with_one_line(cmd: list[str]) -> None:
    """Regression: ``--cors-allowed-origins 'not a url'`` was taken silently (the stack started; no browser can send
    such an Origin, so CORS stayed off for what was meant)."""
    r = subprocess.run(dplb_cmd(*cmd, "--cors-allowed-origins", "https://ok.example,not a url,https://b.example/"),
                       capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stderr.strip().splitlines() if "SIM" not in ln]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--cors-allowed-origins: 'not a url', 'https://b.example/' are not origins: an origin is " \
           "SCHEME://HOST[:PORT]" in lines[0], r.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["usage", "--url", "localhost:30000"], "--url must be the router's http://HOST:PORT"),
    (["fleet", "haproxy-config", "--hosts", "10.0.0.1:30000", "-o", "/nonexistent/dir/haproxy.cfg"],
     "-o /nonexistent/dir/haproxy.cfg: cannot write it: No such file or directory"),
    (["launch", "--num-workers", "1", "--emit-systemd", "/dev/null"], "exists and is not a directory"),
    (["launch", "--num-workers", "1", "--port", "70000"], "argument --port: must be a TCP port 1..65535, got '70000'"),
    (["segment", "create", "--num-workers", "2"], "pass --shm-path PATH (or set DPLB_SHM_PATH"),
    (["segment", "create", "--shm-path", "/dev/shm/dplb_state_never_made", "--num-workers", "65"],
     "--num-workers (or DPLB_NUM_WORKERS) must be 1..64, got 65"),
    (["segment", "create", "--shm-path", "/dev/shm/dplb_state_never_made", "--num-workers", "2",
      "--state-interval-ms", "0"], "--state-interval-ms must be 1..60000 ms, got 0"),
    (["segment", "create", "--shm-path", "/nonexistent_dplb_dir/seg", "--num-workers", "2"],
     "cannot create segment '/nonexistent_dplb_dir/seg': its directory /nonexistent_dplb_dir does not exist"),
    (["launch", "--num-workers", "1", "--port", str(free_port()), "--state-interval-ms", "99999999999"],
     "--state-interval-ms must be 1..60000 ms, got 99999999999"),
    (["launch", "--num-workers", "1", "--port", str(free_port()), "--engine", "sim"],
     "unknown sim engine argument(s): --engine sim"),
    (["tenants", "hash-key"], "no key given"),
    (["fleet"], "required: {haproxy-config,envoy-config}"),
    (["tenants"], "required: {hash-key,check}"),
    (["segment"], "required: {create,remove}"),
    ([], "required: COMMAND"),
], ids=["usage-url", "fleet-output", "emit-systemd-file", "launch-port", "segment-path", "segment-65-workers",
        "segment-interval-0", "segment-no-directory", "launch-interval-uint32", "launch-no-abbreviation", "hash-key-eof",
        "fleet-sub", "tenants-sub", "segment-sub", "no-command"])
def test_cli_mistakes_are_one_line(args: list[str], says: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DPLB_SHM_PATH"}
    r = subprocess.run(dplb_cmd(*args), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                       env=env)
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr and says in last, r.stderr
    assert "_cmd" not in r.stderr, r.stderr  # argparse's internal dest names never reach the user


def test_segment_create_names_a_bad_environment_variable_in_one_line() -> None:
    """Regression: ``DPLB_NUM_WORKERS=abc dplb segment create`` (the systemd unit's variable) was a traceback."""
    env = {**os.environ, "DPLB_SHM_PATH": "/dev/shm/dplb_state_never_made", "DPLB_NUM_WORKERS": "abc"}
    r = subprocess.run(dplb_cmd("segment", "create"), capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == ("dplb segment: error: --num-workers (from $DPLB_NUM_WORKERS) must be an integer, "
                                "got 'abc'")
    assert not Path("/dev/shm/dplb_state_never_made").exists()


def _leaf_commands() -> list[list[str]]:
    """Every (sub)command of the CLI, nested ones included (``tenants hash-key``), from its one parser builder."""
    import argparse

    from dplb.cli import build_parser

    def walk(p: argparse.ArgumentParser, path: list[str]) -> list[list[str]]:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [path]
        return [leaf for name, sp in subs[0].choices.items() for leaf in walk(sp, [*path, name])]

    return walk(build_parser(), [])


def test_every_subcommand_names_itself_in_a_one_line_usage_error() -> None:
    """Regression: ``dplb state --bogus`` printed ``dplb: error`` after the whole CLI's usage. Each subcommand's
    unknown argument (a bad value, for the two that pass unknown ones on to the engine) is one line naming it."""
    leaves = _leaf_commands()
    assert ["state"] in leaves and ["tenants", "hash-key"] in leaves and len(leaves) >= 12, leaves
    for cmd in leaves:
        prog = "dplb " + " ".join(cmd)
        bad = {"launch": ["--num-workers", "x"], "worker": ["--worker-id", "x"],
               "segment": ["create", "--bogus"], "fleet": ["--hosts", "10.0.0.1:30000", "--bogus"]}.get(cmd[0], ["--bogus"])
        if cmd == ["tenants", "check"]:  # its FILE first: argparse names a missing positional before an unknown flag
            bad = ["tenants.toml", "--bogus"]
        r = subprocess.run(dplb_cmd(*cmd, *bad), capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), (cmd, r.stderr)
        assert ("unrecognized arguments: --bogus (" if bad[-1] == "--bogus" else "invalid int value: 'x'") in lines[0]
        assert lines[0].endswith(f"(see `{prog} --help`)"), lines


def test_hash_key_reads_a_pipe_without_a_getpass_warning() -> None:
    """Regression: ``echo KEY | dplb tenants hash-key`` printed Python's GetPassWarning (getpass found no terminal);
    stdin that is not a terminal is read as the key, and an empty pipe is one line."""
    from dplb.tenants import hash_key

    r = subprocess.run(dplb_cmd("tenants", "hash-key"), input="key-one\n", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == hash_key("key-one") and r.stderr == "", r.stderr
    r = subprocess.run(dplb_cmd("tenants", "hash-key"), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("dplb tenants hash-key: error: no key given"), r.stderr
    assert len(r.stderr.splitlines()) == 1 and "Warning" not in r.stderr, r.stderr


@pytest.mark.parametrize(("key", "says"), [(" sk-team-a ", "11 characters, has a space at position 1"),
                                           ("two words", "has a space at position 4"), ('quo"te', "outside that alphabet"),
                                           ("tab\tx", "a control character at position 4"), ("kéy", "non-ASCII"),
                                           ("ab=c", "after the '=' padding at position 4")])
def test_hash_key_refuses_a_key_the_router_refuses_as_api_key(key: str, says: str) -> None:
    """Regression: ``printf ' sk-team-a ' | dplb tenants hash-key -`` printed a digest (exit 0) of a key that
    ``--api-key`` refuses and that no client can present; both use one check now: one line, exit 2, key not
    echoed."""
    for args, kw in ((["-"], {"input": key}), ([key], {"input": ""})):
        r = subprocess.run(dplb_cmd("tenants", "hash-key", *args), capture_output=True, text=True, timeout=60, **kw)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, (r.stdout, r.stderr)
        assert "the key must be a bearer token" in r.stderr and says in r.stderr and key not in r.stderr, r.stderr
    r = subprocess.run(dplb_cmd("router", "--num-workers", "1", "--api-key", key, "--port", "1"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr, r.stderr  # the router's --api-key says the same
    r = subprocess.run(dplb_cmd("tenants", "hash-key", "-"), input="sk-Ab0_9.~+/x==\r\n", capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == hashlib.sha256(b"sk-Ab0_9.~+/x==").hexdigest(), r.stderr


def test_doctor_with_a_port_past_65535_fails_the_ports_check() -> None:
    """Regression: ``dplb doctor --port 99999`` died with an OverflowError traceback from bind(). The flag is
    refused while parsing now; a metrics port derived past 65535 is the ports check's FAIL."""
    r = subprocess.run(dplb_cmd("doctor", "--port", "99999", "--num-workers", "1"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "must be a TCP port 1..65535" in r.stderr, r.stderr
    r = subprocess.run(dplb_cmd("doctor", "--port", "65535", "--num-workers", "1"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "[FAIL] ports           not TCP ports (0..65535): [65536]" in r.stdout, r.stdout


def test_try_line_carries_the_key_a_pasted_curl_needs() -> None:
    """The launch banner's curl: no header without keys; ``$DPLB_API_KEY`` with --api-key (a note when that
    variable is not the key); ``$KEY`` and the file with --tenants alone (without it the router answers 401)."""
    from dplb.ops.launcher import try_line

    url = "http://127.0.0.1:30000"
    plain = try_line(url, "m", None, None, None)
    assert "Authorization" not in plain and '"model": "m"' in plain and "\n" not in plain
    assert "$DPLB_API_KEY" in try_line(url, "m", "k", None, "k") and "\n" not in try_line(url, "m", "k", None, "k")
    assert "export DPLB_API_KEY" in try_line(url, "m", "k", "/t.toml", None)
    tenants = try_line(url, "m", None, "/etc/dplb/tenants.toml", None)
    assert '-H "Authorization: Bearer $KEY"' in tenants and "a tenant in /etc/dplb/tenants.toml" in tenants
    assert not any("s3cret" in try_line(url, "m", "s3cret", t, e) for t in (None, "/t.toml") for e in (None, "s3cret"))


def test_emit_systemd_again_without_api_key_removes_the_old_router_env(tmp_path: Path) -> None:
    """Regression: emitting again without --api-key left the earlier router.env, so the router unit still
    required the old key. A router.env that --emit-systemd did not write is left alone."""
    out = tmp_path / "units"
    base = ["launch", "--num-workers", "1", "--emit-systemd", str(out)]
    r = subprocess.run(dplb_cmd(*base, "--api-key", "old-key"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "DPLB_API_KEY=old-key" in (out / "router.env").read_text(), r.stderr
    env = {k: v for k, v in os.environ.items() if k != "DPLB_API_KEY"}
    r = subprocess.run(dplb_cmd(*base), capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and not (out / "router.env").exists(), r.stderr
    assert f"removed {out}/router.env" in r.stderr
    (out / "router.env").write_text("DPLB_API_KEY=hand-written\n")  # not ours: kept
    r = subprocess.run(dplb_cmd(*base), capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and (out / "router.env").read_text() == "DPLB_API_KEY=hand-written\n", r.stderr


@pytest.mark.parametrize("key", ["abc\nDPLB_ROUTER_ARGS=--host 0.0.0.0", "two words", 'quo"te', " padded", "tab\t"])
def test_an_api_key_that_is_not_a_bearer_token_is_refused_before_anything_is_written(tmp_path: Path, key: str) -> None:
    """Regression: --emit-systemd wrote --api-key into router.env unescaped; a newline in it injected a
    DPLB_ROUTER_ARGS line that overrode dplb.env's (router.env is read second). A key must be an RFC 6750 bearer
    token (what an HTTP header can carry anyway): one error line, nothing written, for launch and the router."""
    out = tmp_path / "units"
    env = {k: v for k, v in os.environ.items() if k != "DPLB_API_KEY"}
    for cmd in (["launch", "--num-workers", "1", "--api-key", key, "--emit-systemd", str(out)],
                ["router", "--num-workers", "1", "--api-key", key, "--port", "1"]):
        r = subprocess.run(dplb_cmd(*cmd), capture_output=True, text=True, timeout=60, env=env)
        lines = [ln for ln in r.stderr.strip().splitlines() if "SIM" not in ln]
        assert r.returncode == 2 and len(lines) == 1 and "must be a bearer token" in lines[0], r.stderr
        assert key not in r.stderr  # a secret is never echoed
    assert not out.exists()
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "1", "--api-key", "sk-Ab0_9.~+/x==", "--emit-systemd",
                                str(out)), capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "DPLB_API_KEY=sk-Ab0_9.~+/x==\n" in (out / "router.env").read_text(), r.stderr


def test_readme_alert_table_lists_every_alert_with_its_severity_and_for() -> None:
    """Regression: four alerts of alerts/dplb.rules.yml (the fleet and SLO groups) were missing from the README's
    alert table, the table an SRE reads to know what can page."""
    import yaml

    rules = yaml.safe_load((ROOT / "alerts" / "dplb.rules.yml").read_text())
    want = {r["alert"]: (r["labels"]["severity"], r.get("for", "0m")) for g in rules["groups"] for r in g["rules"]
            if "alert" in r}
    readme = (ROOT / "README.md").read_text()
    rows = {m[1]: (m[2], m[3]) for m in re.finditer(r"^\| `(DPLB\w+)` \| (critical|warning) \| .* \| (\d+[smh]) \|$",
                                                    readme, re.M)}
    assert rows == want


def test_readme_states_the_segment_layout_version() -> None:
    from dplb.state.layout import LAYOUT_VERSION

    assert f"The segment layout is version {LAYOUT_VERSION} " in (ROOT / "README.md").read_text()


def test_usage_at_something_that_is_not_a_dplb_router_says_so(tmp_path: Path) -> None:
    """Regression: ``dplb usage --url`` at Prometheus (any server with a ``/metrics`` page) said the router
    "keeps no usage ledger" and exited 0. A page of another program's metrics (prometheus_client's own process and
    GC families) or an HTML page is "not a DPLB router", exit 1; a real DPLB router without a ledger still says it
    keeps none, exit 0."""
    from prometheus_client import REGISTRY, generate_latest

    from tests.cluster import cluster

    site = tmp_path / "site"
    site.mkdir()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(site)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for page in (generate_latest(REGISTRY), b"<html><body><h1>Prometheus Time Series Collection</h1></body></html>"):
            (site / "metrics").write_bytes(page)
            url = f"http://127.0.0.1:{port}"
            for _ in range(100):
                r = subprocess.run(dplb_cmd("usage", "--url", url + "/"), capture_output=True, text=True, timeout=60)
                if "cannot read" not in r.stderr:  # (the server still starting)
                    break
                time.sleep(0.1)
            assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
            assert r.stderr.strip() == (f"dplb usage: error: {url} is not a DPLB router (no dplb_* metrics at {url}/metrics); --url "
                                        "must be the router's address (dplb launch --port, default "
                                        "http://127.0.0.1:30000)"), r.stderr
    finally:
        server.terminate()
        server.wait(10)
    with cluster(str(tmp_path / "c"), 1) as c:
        r = subprocess.run(dplb_cmd("usage", "--url", c.url), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "keeps no usage ledger" in r.stderr and r.stdout.startswith("TENANT"), r
