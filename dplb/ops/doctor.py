"""``dplb doctor``: pre-flight checks keyed to the seed article's troubleshooting table (docs/DESIGN.md §10).

Each check prints PASS/WARN/FAIL and, when it is not a pass, the fix. Exit code 1 when any check fails.

| Symptom (seed table)         | Check                                                           |
|------------------------------|-----------------------------------------------------------------|
| 503 / no worker registered   | ``ports``, ``run_dir``, ``stale_segments``                      |
| model too large / CUDA OOM   | ``model_memory`` (config.json weights vs per-GPU memory → TP)   |
| missing shm / Docker         | ``shm`` (size and free space of /dev/shm; Docker's 64 MB)       |
| GPU plan                     | ``gpus``, ``plan`` (TP × workers = GPUs)                        |
| compiled build               | ``build`` (pure, or whole and current: :mod:`dplb.native`)      |

Model memory estimate (weights only): parameters from config.json (Llama-style decoder: embeddings + per layer
attention and MLP) × bytes per parameter of ``torch_dtype``; it needs headroom for the KV cache, so the check asks
weights ≤ 0.8 × (per-GPU memory × TP) at the default ``--gpu-memory-utilization`` 0.9 (vLLM docs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import tempfile
from dataclasses import dataclass

from dplb import native
from dplb.errors import ConfigError
from dplb.flags import flag_port, flag_port_or_off
from dplb.ops.plan import plan_gpus
from dplb.ops.ports import PortUse, clash, stack_ports, try_bind
from dplb.runtime.gpu import GpuInfo, discover_gpus, visible_gpu_indices
from dplb.stack import METRICS_HOST, METRICS_PORT_BASE, stack_metrics_port_base, stack_run_dir, worker_metrics_ports
from dplb.state.layout import is_dplb_segment
from dplb.state.segments import segments
from dplb.state.shm import SHM_DIR

MIN_SHM_BYTES = 256 * 1024 * 1024  # below this, warn (vLLM's own IPC also uses /dev/shm)
DOCKER_DEFAULT_SHM = 64 * 1024 * 1024
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}


@dataclass
class Check:
    """One result: ``status`` is "pass", "warn" or "fail"; ``fix`` says what to do when not a pass."""

    name: str
    status: str
    detail: str
    fix: str = ""


def check_gpus(gpus: list[GpuInfo]) -> Check:
    """GPUs visible through NVML."""
    if not gpus:
        return Check("gpus", "warn", "no NVIDIA GPU visible through NVML",
                     "on a GPU host: install the driver, check `nvidia-smi`, and in containers pass --gpus all. "
                     "Without GPUs DPLB runs the sim engine or vLLM on CPU.")
    names = ", ".join(f"{g.index}: {g.name} {g.memory_total_bytes / 2**30:.0f} GiB" for g in gpus)
    return Check("gpus", "pass", f"{len(gpus)} GPU(s): {names}")


def check_plan(indices: list[int], num_workers: int | None, tp: int) -> Check:
    """TP × workers = GPUs."""
    try:
        plan = plan_gpus(indices, num_workers, tp)
    except ConfigError as e:
        what, _, fix = str(e).partition(". Fix: ")
        return Check("plan", "fail", what, fix or "pass --num-workers and --tensor-parallel-size that fit the GPUs "
                     "(dplb doctor --help)")
    return Check("plan", "pass", f"{len(plan)} worker(s) × TP {tp}: {plan}")


def estimate_weight_bytes(config: dict) -> int:
    """Weights of a decoder-only transformer from its HF config.json, bytes (see module docstring)."""
    h = int(config["hidden_size"])
    layers = int(config["num_hidden_layers"])
    vocab = int(config.get("vocab_size", 32000))
    inter = int(config.get("intermediate_size", 4 * h))
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim", h // heads))
    attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    mlp = 3 * h * inter
    emb = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    params = emb + layers * (attn + mlp + 2 * h) + h
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    return params * DTYPE_BYTES.get(dtype, 2)


def check_model_memory(model: str | None, gpus: list[GpuInfo], tp: int) -> Check:
    """Model weights vs per-GPU memory; says when tensor parallelism is needed."""
    if not model:
        return Check("model_memory", "pass", "no --model given (sim engine): nothing to load")
    problem = model_path_problem(model)
    if problem:
        return Check("model_memory", "fail", problem, "pass an existing local model directory (with config.json) "
                     "or a Hugging Face model id (org/name)")
    path = os.path.join(model, "config.json")
    if not os.path.exists(path):
        return Check("model_memory", "warn", f"no config.json at {path} (a hub name?): cannot estimate",
                     "pass a local model directory to get a memory estimate")
    with open(path) as f:
        cfg = json.load(f)
    try:
        need = estimate_weight_bytes(cfg)
    except (KeyError, ValueError, ZeroDivisionError) as e:
        return Check("model_memory", "warn", f"config.json lacks {e}: cannot estimate")
    if not gpus:
        return Check("model_memory", "pass", f"weights ≈ {need / 2**30:.2f} GiB (CPU run: host memory)")
    per_gpu = min(g.memory_total_bytes for g in gpus)
    budget = 0.8 * per_gpu * tp
    if need > budget:
        min_tp = next((t for t in (1, 2, 4, 8, 16) if need <= 0.8 * per_gpu * t), None)
        fix = (f"use --tensor-parallel-size {min_tp} (or more)" if min_tp else "the model does not fit even at TP 16"
               ) + "; or a quantised model. With vLLM, --gpu-memory-utilization 0.85 leaves headroom."
        return Check("model_memory", "fail", f"weights ≈ {need / 2**30:.1f} GiB > 80% of {tp} × "
                     f"{per_gpu / 2**30:.0f} GiB", fix)
    return Check("model_memory", "pass", f"weights ≈ {need / 2**30:.1f} GiB fit {tp} × {per_gpu / 2**30:.0f} GiB")


def model_path_problem(model: str) -> str:
    """Why ``model`` cannot be loaded, checked before any worker starts ("" when it looks loadable): a path
    (absolute, ``./``, ``~`` or existing) must be a directory holding ``config.json``; ``org/name`` is a hub id."""
    looks_local = model.startswith(("/", ".", "~")) or os.path.exists(model) or model.count("/") > 1
    if not looks_local:
        return ""
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        return f"--model {model}: no such directory"
    if not os.path.isdir(path):
        return f"--model {model}: not a directory (vLLM needs the model directory, not a file)"
    if not os.path.exists(os.path.join(path, "config.json")):
        return f"--model {model}: no config.json in the directory (not a Hugging Face model directory)"
    return ""


def check_shm(directory: str = SHM_DIR) -> Check:
    """/dev/shm size and free space."""
    try:
        st = os.statvfs(directory)
    except OSError as e:
        return Check("shm", "fail", f"{directory} unusable: {e}", "mount a tmpfs on /dev/shm")
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{directory}: {total / 2**20:.0f} MiB total, {free / 2**20:.0f} MiB free"
    if total <= DOCKER_DEFAULT_SHM or free < MIN_SHM_BYTES:
        return Check("shm", "warn" if free >= 1 << 20 else "fail", detail + (
            " (Docker's 64 MB default)" if total <= DOCKER_DEFAULT_SHM else ""),
            "run the container with --shm-size=1g (or --ipc=host); remove stale dplb_state_* segments")
    return Check("shm", "pass", detail)


def check_stale_segments(directory: str = SHM_DIR) -> Check:
    """``dplb_state_*`` segments none of whose recorded processes (creator, routers, workers) is alive. A segment
    a live router records is never stale, even after its creator (systemd's oneshot) exited. Removal is suggested
    only for files that carry DPLB's magic; other ``dplb_state_*`` files are named but left alone."""
    found = segments(directory)
    stale = [i.path for i in found if i.stale]
    foreign = [i.path for i in found if i.header is None and not is_dplb_segment(i.path)]
    broken = [i.path for i in found if i.header is None and is_dplb_segment(i.path)]  # old layout, truncated
    if stale or broken:
        detail = f"{len(stale + broken)} segment(s) with no live owner: {', '.join(stale + broken)}"
        if foreign:
            detail += f"; not DPLB segments (left alone): {', '.join(foreign)}"
        return Check("stale_segments", "warn", detail, "remove them: rm " + " ".join(stale + broken))
    if foreign:
        return Check("stale_segments", "warn", f"dplb_state_* file(s) that are not DPLB segments: {', '.join(foreign)}",
                     "DPLB does not touch them; find out what wrote them")
    live = [i.describe() for i in found]
    return Check("stale_segments", "pass", "no stale dplb_state_* segments" + (f"; live: {'; '.join(live)}"
                                                                                if live else ""))


def check_ports(uses: list[PortUse]) -> Check:
    """The stack's TCP ports (:func:`dplb.ops.ports.stack_ports`: router, agent-check, workers' metrics, each on its
    own address) are TCP ports, not one port twice (:func:`dplb.ops.ports.clash`) and can be bound: the errors
    ``dplb launch`` would refuse with, in its words (``what: reason; fix``), the first in full and the others by
    address."""
    bad = [u.port for u in uses if not 0 <= u.port <= 65535]
    if bad:
        return Check("ports", "fail", f"not TCP ports (0..65535): {bad}",
                     "pass a --port (and --metrics-port-base) with room for the router and every worker below 65536")
    twice = clash(uses)
    failed = [(u, err) for u in uses if (err := try_bind(u)) is not None] if twice is None else []
    if twice is None and not failed:
        return Check("ports", "pass", "free: " + ", ".join(f"{u.host}:{u.port}" for u in uses))
    first = twice if twice is not None else failed[0][1]
    what, _, fix = str(first).partition("; ")
    if len(failed) > 1:
        what += "; also cannot bind " + ", ".join(f"{u.host}:{u.port} ({u.who})" for u, _ in failed[1:])
    return Check("ports", "fail", what, fix)


def live_sockets(run_dir: str) -> list[str]:
    """The Unix sockets in ``run_dir`` that a process answers on (a live stack uses the directory), sorted; ``[]``
    when the directory is missing or unreadable. ``dplb launch`` refuses such a run dir, and ``run_dir`` fails."""
    try:
        names = sorted(n for n in os.listdir(run_dir) if n.endswith(".sock"))
    except OSError:
        return []
    live = []
    for n in names:
        path = os.path.join(run_dir, n)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(0.5)
        try:
            s.connect(path)
            live.append(path)
        except OSError:
            pass
        finally:
            s.close()
    return live


def check_run_dir(path: str) -> Check:
    """The run directory: no live stack serves sockets in it, and it is a directory where a file can be created or
    one that can be made. Tried, not guessed: the missing directories are made and a file created in it, then both
    removed (a permission test says yes to root on ``/proc/x`` or on a read-only mount). The one check ``dplb
    launch`` refuses a run dir by (:meth:`dplb.ops.launcher.Launcher.preflight`), so the two cannot disagree."""
    live = live_sockets(path)
    if live:
        return Check("run_dir", "fail", f"{path} is in use: {live[0]} is served by a running process (another "
                     "`dplb launch`?)",
                     "stop it, or start this stack on another --port (its run dir and metrics ports follow) or "
                     "--run-dir")
    made: list[str] = []
    try:
        missing, p = [], os.path.abspath(path)
        while not os.path.lexists(p):
            missing.append(p)
            p = os.path.dirname(p)
        verb = "create the run directory"
        for d in reversed(missing):
            os.mkdir(d, 0o700)
            made.append(d)
        verb = "create files in the run directory"
        fd, probe = tempfile.mkstemp(dir=path, prefix=".dplb-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return Check("run_dir", "fail", f"cannot {verb} {path}: {e.strerror or e}",
                     "pass --run-dir to a writable directory")
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(d)
    return Check("run_dir", "pass", f"{path} is writable" if not made else f"{path} can be created")


def check_build(build: native.Build | None = None) -> Check:
    """Which build runs (default: this process's, :func:`dplb.native.build`): pure Python or a whole, current
    compiled build pass; a partial one fails (every ``dplb`` command refuses it before this check could run, so
    this is for a caller with another package directory), and so does a stale one, even run anyway
    (``DPLB_ACCEPT_STALE_BUILD=1``)."""
    b = build or native.build()
    n = f"{len(b.compiled)}/{len(native.HOT_MODULES)} hot modules"
    if b.pure:
        return Check("build", "pass", "pure Python (scripts/build_native.sh compiles the hot path)")
    if b.partial:
        return Check("build", "fail", b.refusal(), native.FIXES)
    if b.stale:
        stale = ", ".join(f"dplb/{p}" for p in b.stale)
        return Check("build", "fail", f"compiled ({n}) but stale: {stale} changed since the build; the compiled "
                     f"modules run the old code", native.FIXES)
    return Check("build", "pass", f"compiled ({n}; the manifest matches every .so and source)")


def run_checks(args: argparse.Namespace) -> list[Check]:
    """Every check for these arguments."""
    gpus = discover_gpus()
    visible = visible_gpu_indices()
    if visible is not None:
        gpus = [g for g in gpus if g.index in visible]
    indices = [g.index for g in gpus]
    n = args.num_workers or (len(indices) // args.tensor_parallel_size if indices else 2)
    ports = stack_ports(args.host, args.port, args.metrics_host,
                        worker_metrics_ports(stack_metrics_port_base(args.port, args.metrics_port_base), n),
                        args.agent_port)
    return [
        check_gpus(gpus),
        check_plan(indices, args.num_workers, args.tensor_parallel_size),
        check_model_memory(args.model, gpus, args.tensor_parallel_size),
        check_shm(args.shm_dir),
        check_stale_segments(args.shm_dir),
        check_ports(ports),
        check_run_dir(args.run_dir or stack_run_dir(args.port)),
        check_build(),
    ]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``dplb doctor``."""
    p = sub.add_parser("doctor", help="pre-flight checks (GPUs, plan, model memory, /dev/shm, segments, ports, "
                       "compiled build)")
    p.add_argument("--model", help="local model directory to size against GPU memory")
    p.add_argument("--num-workers", type=int)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=flag_port, default=30000, help="router port to check (default 30000)")
    p.add_argument("--metrics-port-base", type=flag_port_or_off, default=None,
                   help=f"worker metrics ports to check: BASE+K (default {METRICS_PORT_BASE}+K; 0 = none)")
    p.add_argument("--metrics-host", default=METRICS_HOST,
                   help=f"address the workers' metrics ports bind (default {METRICS_HOST}, as `dplb launch`)")
    p.add_argument("--agent-port", type=flag_port, default=None, metavar="PORT",
                   help="the HAProxy agent-check port to check (on --host; default: none, as `dplb launch`)")
    p.add_argument("--run-dir", help="run directory to check (default: the one `dplb launch --port PORT` uses)")
    p.add_argument("--shm-dir", default=SHM_DIR, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_doctor)


def _cmd_doctor(args: argparse.Namespace, rest: list[str]) -> int:
    checks = run_checks(args)
    if args.json:
        print(json.dumps([c.__dict__ for c in checks], indent=2))
    else:
        for c in checks:
            print(f"[{c.status.upper():4}] {c.name:15} {c.detail}")
            if c.fix:
                print(f"       {'':15} fix: {c.fix}")
    return 1 if any(c.status == "fail" for c in checks) else 0
