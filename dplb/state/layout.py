"""Segment header layout, path rules and the router registry of the state segment (split out of :mod:`dplb.state.shm`).

The byte layout is documented in :mod:`dplb.state.shm`; this module owns the header (decode, the router registry
entries, the run directory) and the path-safety rules every command shares:

- A path is a DPLB segment only when it is a regular file whose first bytes are the magic ``DPLB``
  (:func:`is_dplb_segment`). DPLB never overwrites, truncates or unlinks anything else.
- Removal is advised (``rm …``) only for a DPLB segment under ``/dev/shm`` (:class:`dplb.errors.ShmLayoutError`,
  ``dplb doctor``).
- Routers record themselves in the header (:func:`register_router`: pid + port, under ``flock``), so a segment
  used by a live router is never called stale, even when its creator (systemd's oneshot) has exited.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import struct
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Final

from dplb.errors import ShmError, ShmLayoutError, ShmMissingError, ShmPathError

MAGIC: Final = b"DPLB"
LAYOUT_VERSION: Final = 8  # 8: a health table in each router slot (dplb.state.health_board); 7: a tenant table per
#                      router slot (dplb.state.tenant_tables); 6: a response-id ring per router slot
#                      (dplb.state.response_rings); 5: a KV ring per worker (dplb.state.kv_rings); 4: engine progress
#                      in each worker slot; 3: KV blocks in each worker slot; 2: router slots, 16 router entries
#                      (docs/DESIGN.md §3)
HEADER_SIZE: Final = 4096
SLOT_SIZE: Final = 192
MAX_WORKERS: Final = 64
MAX_GPUS_PER_WORKER: Final = 15
MODEL_NAME_BYTES: Final = 128
SHM_DIR: Final = "/dev/shm"
SEGMENT_PREFIX: Final = "dplb_state_"
ENV_SHM_PATH: Final = "DPLB_SHM_PATH"

HEADER: Final = struct.Struct("<4sHHHHIQII128s")  # 160 bytes
GPU_ENTRY: Final = struct.Struct("<B15s")
GPU_MAP_OFFSET: Final = 160
#: Router registry: MAX_ROUTERS entries {u32 pid, u16 port, u16 reserved} at ROUTERS_OFFSET (0 pid = free).
ROUTER_ENTRY: Final = struct.Struct("<IHH")
ROUTERS_OFFSET: Final = 1184
MAX_ROUTERS: Final = 16
#: Run directory of the worker sockets (UTF-8, NUL-padded; empty when the creator did not know it).
RUN_DIR_OFFSET: Final = ROUTERS_OFFSET + MAX_ROUTERS * ROUTER_ENTRY.size  # 1312
RUN_DIR_BYTES: Final = 256
HEADER_READ: Final = RUN_DIR_OFFSET + RUN_DIR_BYTES  # 1568: the bytes a header decode needs
#: Router slots (dplb.state.router_slots) after the worker slots: a 64-byte head, 16 bytes per possible worker (the
#: in-flight entries), then 32 bytes per possible worker (the health table, dplb.state.health_board).
HEALTH_TABLE_OFFSET: Final = 64 + 16 * MAX_WORKERS  # 1088, within a router slot
HEALTH_ENTRY_SIZE: Final = 32
ROUTER_SLOT_SIZE: Final = HEALTH_TABLE_OFFSET + HEALTH_ENTRY_SIZE * MAX_WORKERS  # 3136
#: Prefix rings (dplb.state.router_slots) after the router slots, one per router slot: a 64-byte head + u64 entries.
PREFIX_RING_ENTRIES: Final = 8192
PREFIX_RING_SIZE: Final = 64 + 8 * PREFIX_RING_ENTRIES  # 65600
#: KV rings (dplb.state.kv_rings) after the prefix rings, one per worker slot: a 64-byte head + u64 entries.
KV_RING_ENTRIES: Final = 8192
KV_RING_SIZE: Final = 64 + 8 * KV_RING_ENTRIES  # 65600
#: Response-id rings (dplb.state.response_rings) after the KV rings, one per router slot: a 64-byte head + 16-byte
#: entries.
RESPONSE_RING_ENTRIES: Final = 4096
RESPONSE_RING_SIZE: Final = 64 + 16 * RESPONSE_RING_ENTRIES  # 65600
#: Tenant tables (dplb.state.tenant_tables) after the response-id rings, one per router slot: 64-byte entries.
TENANT_TABLE_ENTRIES: Final = 64
TENANT_TABLE_SIZE: Final = 64 * TENANT_TABLE_ENTRIES  # 4096
assert HEADER.size == 160 and HEADER_READ <= HEADER_SIZE


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """Decoded segment header. ``routers``: (pid, port) of each registered router (live or not)."""

    layout_version: int
    num_workers: int
    slot_size: int
    state_interval_ms: int
    created_unix_ns: int
    creator_pid: int
    model: str
    gpu_map: tuple[tuple[int, ...], ...] = field(default=())
    routers: tuple[tuple[int, int], ...] = field(default=())
    run_dir: str = ""

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly dict."""
        return {**asdict(self), "gpu_map": [list(g) for g in self.gpu_map],
                "routers": [{"pid": p, "port": port} for p, port in self.routers]}


def segment_size(num_workers: int) -> int:
    """Total bytes of a segment with ``num_workers`` worker slots (plus the :data:`MAX_ROUTERS` router slots and
    prefix rings, about 1 MiB, one KV ring of 64 KiB per worker, :data:`MAX_ROUTERS` response-id rings, 1 MiB, and as
    many tenant tables, 64 KiB)."""
    return tenant_tables_offset(num_workers) + MAX_ROUTERS * TENANT_TABLE_SIZE


def kv_rings_offset(num_workers: int) -> int:
    """Offset of worker 0's KV ring in a segment with ``num_workers`` worker slots, bytes."""
    return HEADER_SIZE + num_workers * SLOT_SIZE + MAX_ROUTERS * (ROUTER_SLOT_SIZE + PREFIX_RING_SIZE)


def response_rings_offset(num_workers: int) -> int:
    """Offset of router slot 0's response-id ring in a segment with ``num_workers`` worker slots, bytes."""
    return kv_rings_offset(num_workers) + num_workers * KV_RING_SIZE


def tenant_tables_offset(num_workers: int) -> int:
    """Offset of router slot 0's tenant table in a segment with ``num_workers`` worker slots, bytes."""
    return response_rings_offset(num_workers) + MAX_ROUTERS * RESPONSE_RING_SIZE


def default_segment_path(now_s: int | None = None, pid: int | None = None) -> str:
    """``/dev/shm/dplb_state_<unix seconds>_<pid>`` (docs/DESIGN.md §3): the creating process's id keeps two stacks
    started in the same second apart."""
    secs = int(time.time() if now_s is None else now_s)
    return os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{secs}_{os.getpid() if pid is None else pid}")


def resolve_path(path: str | None) -> str:
    """The segment path from ``path``, else ``$DPLB_SHM_PATH``. Raises :class:`ShmMissingError` when neither."""
    p = path or os.environ.get(ENV_SHM_PATH)
    if not p:
        raise ShmMissingError(None)
    return p


def is_dplb_segment(path: str) -> bool:
    """True when ``path`` is a regular file that starts with DPLB's magic (never follows into devices or FIFOs)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            return False
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def check_not_foreign(path: str) -> None:
    """Refuse a path DPLB must not touch: a directory, a device/FIFO/socket, or a file that is not a DPLB segment.
    A missing path passes. Raises :class:`ShmError` naming the path and what to do."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (creating it says why it cannot)
        return
    except OSError as e:
        raise ShmError(f"cannot inspect the segment path '{path}': {e.strerror}", path) from e
    if stat.S_ISDIR(st.st_mode):
        raise ShmPathError(f"segment path '{path}' is a directory, not a DPLB segment; pass a file path such as "
                       f"{SHM_DIR}/{SEGMENT_PREFIX}mystack", path)
    if not is_dplb_segment(path):
        raise ShmPathError(f"'{path}' exists and is not a DPLB segment (no DPLB magic); DPLB will not overwrite or "
                       f"remove it. Pass another --shm-path (e.g. {SHM_DIR}/{SEGMENT_PREFIX}mystack) or unset "
                       f"{ENV_SHM_PATH}", path)


def decode_header(path: str, raw: bytes, file_size: int) -> SegmentHeader:
    """Decode and validate a header from its first :data:`HEADER_READ` bytes. Raises :class:`ShmLayoutError`."""
    if len(raw) < HEADER_READ:
        raise ShmLayoutError(path, f"file is {file_size} bytes, smaller than the {HEADER_SIZE}-byte header",
                             dplb_magic=raw[:4] == MAGIC)
    magic, version, hsize, n, ssize, interval, created, cpid, _r, model_b = HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        raise ShmLayoutError(path, f"no DPLB magic ({magic!r}, expected {MAGIC!r})", dplb_magic=False)
    if version != LAYOUT_VERSION:
        older = "an older" if version < LAYOUT_VERSION else "a newer"
        raise ShmLayoutError(path, f"layout version {version}, this DPLB reads version {LAYOUT_VERSION} (made by "
                             f"{older} DPLB; every worker and router must run one version)")
    if hsize != HEADER_SIZE or ssize != SLOT_SIZE:
        raise ShmLayoutError(path, f"header/slot size {hsize}/{ssize}, expected {HEADER_SIZE}/{SLOT_SIZE}")
    if not 1 <= n <= MAX_WORKERS:
        raise ShmLayoutError(path, f"num_workers {n} outside 1..{MAX_WORKERS}")
    if file_size < segment_size(n):
        raise ShmLayoutError(path, f"file is {file_size} bytes, {n} workers need {segment_size(n)}")
    if interval <= 0:
        raise ShmLayoutError(path, f"state_interval_ms {interval} must be > 0")
    gmap = []
    for w in range(n):
        cnt, idx = GPU_ENTRY.unpack_from(raw, GPU_MAP_OFFSET + 16 * w)
        gmap.append(tuple(idx[: min(cnt, MAX_GPUS_PER_WORKER)]))
    routers = tuple((pid, port) for pid, port, _ in (ROUTER_ENTRY.unpack_from(raw, ROUTERS_OFFSET + i * 8)
                                                     for i in range(MAX_ROUTERS)) if pid)
    run_dir = raw[RUN_DIR_OFFSET:RUN_DIR_OFFSET + RUN_DIR_BYTES].rstrip(b"\0").decode(errors="replace")
    return SegmentHeader(version, n, ssize, interval, created, cpid, model_b.rstrip(b"\0").decode(errors="replace"),
                         tuple(gmap), routers, run_dir)


def encode_run_dir(run_dir: str) -> bytes:
    """The run-directory field; raises ``ValueError`` when it does not fit :data:`RUN_DIR_BYTES`."""
    b = run_dir.encode()
    if len(b) > RUN_DIR_BYTES:
        raise ValueError(f"run directory path is {len(b)} bytes; at most {RUN_DIR_BYTES} fit the segment header")
    return b


def pid_alive(pid: int) -> bool:
    """True when process ``pid`` exists (also when it belongs to another user)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _locked_fd(path: str) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def register_router(path: str, port: int, pid: int | None = None) -> int | None:
    """Record router ``pid`` (default: this process) and its TCP ``port`` in the segment's router registry: its own
    entry, else a free one, else one whose process is gone. Returns the entry's index (also the index of the
    router's slot, :mod:`dplb.state.router_slots`), or None (recording nothing) when the segment cannot be written or
    all :data:`MAX_ROUTERS` entries belong to live processes."""
    try:
        with _locked_fd(path) as fd:
            return _register(fd, port, os.getpid() if pid is None else pid)
    except OSError:
        return None


def register_router_fd(fd: int, port: int, pid: int) -> int | None:
    """:func:`register_router` in the segment file open on ``fd`` (read-write): the file a caller already holds,
    whatever is at its path now. Takes and releases the same ``flock``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            return _register(fd, port, pid)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        return None


def _register(fd: int, port: int, pid: int) -> int | None:
    if os.pread(fd, 4, 0) != MAGIC:
        return None
    raw = os.pread(fd, MAX_ROUTERS * ROUTER_ENTRY.size, ROUTERS_OFFSET)
    entries = [ROUTER_ENTRY.unpack_from(raw, i * ROUTER_ENTRY.size) for i in range(MAX_ROUTERS)]
    slot = next((i for i, e in enumerate(entries) if e[0] == pid), None)
    if slot is None:
        slot = next((i for i, e in enumerate(entries) if e[0] == 0 or not pid_alive(e[0])), None)
    if slot is None:
        return None
    os.pwrite(fd, ROUTER_ENTRY.pack(pid, port & 0xFFFF, 0), ROUTERS_OFFSET + slot * ROUTER_ENTRY.size)
    return slot


def unregister_router(path: str, pid: int | None = None) -> None:
    """Clear router ``pid``'s registry entry (default: this process). Never raises."""
    pid = os.getpid() if pid is None else pid
    with contextlib.suppress(OSError), _locked_fd(path) as fd:
        if os.pread(fd, 4, 0) != MAGIC:
            return
        for i in range(MAX_ROUTERS):
            off = ROUTERS_OFFSET + i * ROUTER_ENTRY.size
            if ROUTER_ENTRY.unpack(os.pread(fd, ROUTER_ENTRY.size, off))[0] == pid:
                os.pwrite(fd, bytes(ROUTER_ENTRY.size), off)


def list_segments(directory: str = SHM_DIR) -> list[str]:
    """Paths of ``dplb_state_*`` files in ``directory``, newest (by mtime) first. Ignores temp files."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(SEGMENT_PREFIX) and ".tmp." not in n]
    except FileNotFoundError:
        return []
    paths = [os.path.join(directory, n) for n in names]
    return sorted(paths, key=lambda p: os.stat(p).st_mtime if os.path.exists(p) else 0, reverse=True)
