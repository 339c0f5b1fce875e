"""Worker placement (dplb/ops/placement.py): the planning rules on given topologies and GPU affinities, the NVML and
sysfs readings behind their seams, the flags' errors, the systemd drop-ins, and `dplb launch` on the sim engine
pinning its children (and keeping them in its session, one kernel autogroup)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import ROOT, dplb_cmd, launched

from dplb.errors import ConfigError
from dplb.ops.placement import OMP_ENV, plan_placement, resolve
from dplb.runtime.cpus import CpuInfo, cpu_topology, format_cpu_list, parse_cpu_list
from dplb.runtime.gpu import cpus_from_mask, gpu_cpu_affinity


def topo(ncpus: int, nodes: int = 1, smt: int = 1) -> list[CpuInfo]:
    """``ncpus`` logical CPUs on ``nodes`` equal NUMA nodes; with ``smt`` = 2, CPU c and c + ncpus/2 are siblings
    (Linux's usual numbering)."""
    cores = ncpus // smt
    return [CpuInfo(c, (c % cores) * nodes // cores, (0, c % cores)) for c in range(ncpus)]


def all_cpus(p: tuple[tuple[int, ...], ...]) -> list[int]:
    return [c for w in p for c in w]


# ---- planning (pure) ------------------------------------------------------------------------------------------
def test_two_core_host_gives_each_vllm_worker_one_core_and_leaves_the_router_unpinned() -> None:
    p = plan_placement(topo(2), 2, router_cores=1, strict=True, omp=True)
    assert p.workers == ((0,), (1,)) and p.omp == ((0,), (1,)) and p.router == ()
    assert any("router not pinned" in n for n in p.notes)
    assert p.worker_env(1) == {OMP_ENV: "1"}


def test_sixteen_cores_keep_router_cores_and_an_api_core_per_worker() -> None:
    p = plan_placement(topo(16), 2, router_cores=2, strict=True, omp=True)
    assert p.workers == (tuple(range(0, 7)), tuple(range(7, 14))) and p.router == (14, 15)
    assert p.omp == (tuple(range(0, 6)), tuple(range(7, 13)))  # the last core of each share: its API server
    assert p.describe()[0] == "worker 0: 0-6 (OpenMP 0-5), worker 1: 7-13 (OpenMP 7-12); router: 14-15"


def test_shares_are_equal_and_the_remainder_goes_to_the_router() -> None:
    p = plan_placement(topo(8), 3, router_cores=1, strict=True, omp=True)
    assert [len(w) for w in p.workers] == [2, 2, 2] and p.router == (6, 7)
    assert len(set(all_cpus(p.workers)) | set(p.router)) == 8 and not set(all_cpus(p.workers)) & set(p.router)


def test_smt_siblings_stay_together_and_openmp_uses_one_per_core() -> None:
    p = plan_placement(topo(16, smt=2), 2, router_cores=1, strict=True, omp=True)
    assert p.workers[0] == (0, 1, 2, 8, 9, 10) and p.omp[0] == (0, 1)  # cores 0-2 with siblings 8-10; core 2 kept
    for w in p.workers:
        assert all((c + 8) % 16 in w for c in w)  # never half a core


def test_each_worker_stays_on_one_numa_node() -> None:
    p = plan_placement(topo(32, nodes=2), 3, router_cores=1, strict=True, omp=True)
    for w in p.workers:
        assert len({c // 16 for c in w}) == 1, p
    assert len(set(all_cpus(p.workers))) == len(all_cpus(p.workers))  # disjoint


def test_fewer_cores_than_vllm_workers_is_a_one_line_error_and_shares_elsewhere() -> None:
    with pytest.raises(ConfigError, match="3 vLLM CPU workers need a core each, but 2 core") as e:
        plan_placement(topo(2), 3, strict=True)
    assert "--num-workers 2" in str(e.value) and "--worker-cpus off" in str(e.value) and "\n" not in str(e.value)
    p = plan_placement(topo(2), 3)  # not strict: they share, and the notes say so
    assert p.workers == ((0, 1),) * 3 and any("share CPUs 0-1" in n for n in p.notes)


def test_gpu_workers_are_placed_on_their_gpus_numa_node() -> None:
    aff = {0: list(range(8)), 1: list(range(8)), 2: list(range(8, 16)), 3: list(range(8, 16))}
    p = resolve(None, None, engine="vllm", gpu_groups=[[0], [1], [2], [3]], topology=topo(16, nodes=2),
                gpu_affinity=aff, router_cores=2)
    assert [set(w) <= set(aff[k]) for k, w in enumerate(p.workers)] == [True] * 4
    assert len(set(all_cpus(p.workers))) == len(all_cpus(p.workers)) and all(p.workers)
    assert p.omp == ((),) * 4  # vLLM's CUDA platform does not read the OpenMP binding
    assert len(p.router) >= 2 and not set(p.router) & set(all_cpus(p.workers))


def test_gpu_home_outside_the_allowed_cpus_falls_back_to_all_allowed() -> None:
    p = resolve(None, None, engine="vllm", gpu_groups=[[0], [1]], topology=topo(4),
                gpu_affinity={0: [40, 41], 1: [42]}, router_cores=1)
    assert all(p.workers) and not set(p.workers[0]) & set(p.workers[1])


def test_sim_is_not_pinned_by_default_and_auto_pins_it() -> None:
    off = resolve(None, None, engine="sim", gpu_groups=[[], []], topology=topo(4), gpu_affinity={}, router_cores=1)
    assert off.workers == ((), ()) and off.router == () and off.worker_env(0) == {}
    assert off.describe()[0].startswith("not pinned")
    on = resolve("auto", None, engine="sim", gpu_groups=[[], []], topology=topo(4), gpu_affinity={}, router_cores=1)
    assert all(on.workers) and on.omp == ((), ())  # pinned, but the sim has no OpenMP threads


def test_explicit_lists_and_router_override() -> None:
    p = resolve("0-3|4-7", "8", engine="vllm", gpu_groups=[[], []], topology=topo(16), gpu_affinity={},
                router_cores=1)
    assert p.workers == ((0, 1, 2, 3), (4, 5, 6, 7)) and p.omp == ((0, 1, 2), (4, 5, 6)) and p.router == (8,)
    p = resolve("0-3|4-7", None, engine="vllm", gpu_groups=[[], []], topology=topo(10), gpu_affinity={},
                router_cores=1)
    assert p.router == (8, 9)  # auto: what the workers do not use
    assert resolve("0|1", "off", engine="vllm", gpu_groups=[[], []], topology=topo(2), gpu_affinity={},
                   router_cores=1).router == ()


@pytest.mark.parametrize(("spec", "router", "needle"), [
    ("0-3", None, "gives 1 CPU list(s) for 2 worker(s)"),
    ("0-3|3-5", None, "workers 0 and 1 share CPU 3"),
    ("0|x", None, "--worker-cpus: 'x' is not a CPU list"),
    ("0|99", None, "CPU(s) 99 not available to this process (allowed: 0-7)"),
    ("0|5-2", None, "is not a range A-B"),
    ("0|1", "1,", "--router-cpus: '1,' is not a CPU list"),
    ("0|1", "12", "--router-cpus: CPU(s) 12 not available"),
])
def test_bad_placement_flags_are_one_line_errors(spec: str, router: str | None, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        resolve(spec, router, engine="vllm", gpu_groups=[[], []], topology=topo(8), gpu_affinity={}, router_cores=1)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_cpu_list_syntax_round_trips() -> None:
    assert parse_cpu_list("0-3,8, 10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11" and format_cpu_list([]) == ""
    for bad in ("", "a", "1-", "-1", "3-1"):
        with pytest.raises(ConfigError):
            parse_cpu_list(bad)


# ---- the readings behind their seams ------------------------------------------------------------------------
def test_sysfs_topology_from_a_tree(tmp_path: Path) -> None:
    cpu, node = tmp_path / "cpu", tmp_path / "node"
    for c, core in ((0, 0), (1, 1), (2, 0), (3, 1)):
        d = cpu / f"cpu{c}" / "topology"
        d.mkdir(parents=True)
        (d / "core_id").write_text(f"{core}\n")
        (d / "physical_package_id").write_text("0\n")
    (node / "node0").mkdir(parents=True)
    (node / "node0" / "cpulist").write_text("0-1\n")
    (node / "node1").mkdir()
    (node / "node1" / "cpulist").write_text("2-3\n")
    t = cpu_topology([0, 1, 2, 3, 4], str(cpu), str(node))
    assert [(c.cpu, c.node, c.core) for c in t] == [(0, 0, (0, 0)), (1, 0, (0, 1)), (2, 1, (0, 0)),
                                                    (3, 1, (0, 1)), (4, 0, (0, -5))]  # cpu4: no files
    p = plan_placement(t[:4], 2, router_cores=0, strict=True)
    assert p.workers == ((0, 1), (2, 3))  # one node each


class FakeNvml:
    """pynvml's affinity calls as a driver answers them: GPU 0 on CPUs 0-3 and 64, GPU 1 on 4-7; GPU 2 errors."""

    NVML_AFFINITY_SCOPE_NODE = 0

    def __init__(self, scoped: bool = True) -> None:
        self.scoped = scoped
        self.calls: list[tuple[int, int]] = []

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i == 2:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return i

    def nvmlDeviceGetCpuAffinityWithinScope(self, h: int, words: int, scope: int) -> list[int]:
        if not self.scoped:
            raise RuntimeError("NVML_ERROR_FUNCTION_NOT_FOUND")
        self.calls.append((h, words))
        return [0x0F, 0x1][:words] if h == 0 else [0xF0, 0][:words]

    def nvmlDeviceGetCpuAffinity(self, h: int, words: int) -> list[int]:
        return [0x0F] if h == 0 else [0xF0]


def test_nvml_affinity_reading() -> None:
    assert cpus_from_mask([0b1011, 1]) == [0, 1, 3, 64]
    nv = FakeNvml()
    assert gpu_cpu_affinity([0, 1, 2], ncpus=128, nvml=nv) == {0: [0, 1, 2, 3, 64], 1: [4, 5, 6, 7]}
    assert nv.calls == [(0, 2), (1, 2)]  # 128 CPUs: two 64-bit words
    assert gpu_cpu_affinity([0, 1], ncpus=8, nvml=FakeNvml(scoped=False)) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert gpu_cpu_affinity([0]) == {}  # this host: no NVML, no error


# ---- the launcher -------------------------------------------------------------------------------------------
def _affinity(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


def test_emit_systemd_writes_placement_dropins(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs for two workers")
    spec = f"{cpus[0]}|{cpus[1]}"
    model = tmp_path / "model"  # --emit-systemd checks --model like launch does: a real (empty) model directory
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "units"
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--model", str(model), "--worker-cpus", spec,
                                "--router-cpus", str(cpus[-1]), "--emit-systemd", str(out)),
                       capture_output=True, text=True, timeout=60, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    for k in range(2):
        conf = (out / f"dplb-worker@{k}.service.d" / "placement.conf").read_text()
        assert f"[Service]\nCPUAffinity={cpus[k]}\nAllowedCPUs={cpus[k]}\n" in conf
        assert f"{OMP_ENV}={cpus[k]}\n" in (out / f"worker-{k}.env").read_text()
    assert f"CPUAffinity={cpus[-1]}\n" in (out / "dplb-router.service.d" / "placement.conf").read_text()
    assert "placement.conf" in r.stdout and "/etc/systemd/system/" in r.stdout
    _verify_with_dropins(out)
    bad = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--model", str(model), "--worker-cpus", "0",
                                  "--emit-systemd",
                                  str(tmp_path / "x")), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "gives 1 CPU list(s) for 2 worker(s)" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def _verify_with_dropins(out: Path) -> None:
    """``systemd-analyze verify`` the units with the drop-ins in ``out`` beside them: no output (it reports a value
    it cannot parse, e.g. ``Failed to parse CPU affinity``)."""
    sa = shutil.which("systemd-analyze")
    if sa is None:
        return
    dplb_bin = shutil.which("dplb") or os.path.join(os.path.dirname(sys.executable), "dplb")
    for u in ("dplb.target", "dplb-segment.service", "dplb-router.service", "dplb-worker@.service"):
        text = Path(ROOT, "deploy", "systemd", u).read_text()
        (out / u).write_text(text.replace("/opt/dplb/venv/bin/dplb", dplb_bin))
    (out / "dplb-worker@0.service").symlink_to(out / "dplb-worker@.service")
    r = subprocess.run([sa, "verify", str(out / "dplb-router.service"), str(out / "dplb-worker@0.service")],
                       capture_output=True, text=True, cwd=out, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


@pytest.mark.parametrize("spec", [None, "auto"])
def test_launch_pins_sim_workers_only_when_asked_and_keeps_them_in_its_session(tmp_path: Path,
                                                                              spec: str | None) -> None:
    """The sim is not pinned by default; with --worker-cpus auto no two workers share a CPU. Either way each child
    has its own process group (a terminal's Ctrl-C goes to the launcher, which drains them) but the launcher's
    session: a session is a kernel autogroup, and engines in separate autogroups starved each other."""
    if spec and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    extra = ["--worker-cpus", spec] if spec else []
    # process_group=0: like a shell's job, its own process group
    with launched(tmp_path, "--num-workers", "2", "--drain-timeout", "5", *extra, process_group=0) as ln:
        proc, log, shm = ln.proc, ln.log, ln.shm
        ln.wait_ready(60)
        st = ln.state()
        pids = [w["pid"] for w in st["workers"]] + [r["pid"] for r in st["routers"]]
        sets = [_affinity(p) for p in pids]
        assert [w["cpus"] for w in st["workers"]] == [sorted(s) for s in sets[:2]]  # dplb state shows it
        banner = log.read_text()
        if spec is None:
            assert all(s == _affinity(proc.pid) for s in sets)
            assert "cpus:    not pinned" in banner
        else:
            assert sets[0] and sets[1] and not sets[0] & sets[1], sets
            assert f"cpus:    worker 0: {format_cpu_list(sets[0])}, worker 1: {format_cpu_list(sets[1])}" in banner
        for p in pids:
            assert os.getsid(p) == os.getsid(proc.pid), "a child left the launcher's session (its own autogroup)"
            assert os.getpgid(p) != os.getpgid(proc.pid), "a child in the launcher's process group gets Ctrl-C"
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the launcher's group only
        assert proc.wait(30) == 0
        assert "stopped; sockets removed" in log.read_text()
        assert not os.path.exists(shm)
