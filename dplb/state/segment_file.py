"""The state segment's file: made whole, opened only when it is a DPLB segment of this layout, and mapped.

Contract (the byte layout is :mod:`dplb.state.shm`'s docstring; the header's constants and decoding are
:mod:`dplb.state.layout`'s; :class:`dplb.state.shm.Segment` is what callers use):

- :func:`create_file` writes a new segment under a temporary name in the target's directory — its pages reserved
  (``posix_fallocate``: a full tmpfs fails here, not with a SIGBUS later), its header written, the worker slots and
  everything after them zero — and renames it into place, so a reader never sees a half-written header. It
  replaces only a DPLB segment (:func:`dplb.state.layout.check_not_foreign`), and only when asked.
- :func:`map_file` opens a segment, validates its header (:func:`dplb.state.layout.decode_header`) and maps the
  whole segment; a directory, a device or a FIFO is refused before it is opened.
- :func:`restore_header` fills the header fields that are empty (model, GPU map, run directory) in a mapping and
  never touches another field.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import time

from dplb.config import MAX_STATE_INTERVAL_MS
from dplb.errors import ShmCreateError, ShmError, ShmLayoutError, ShmMissingError, ShmPathError, ShmSpaceError
from dplb.state.layout import (
    GPU_ENTRY,
    GPU_MAP_OFFSET,
    HEADER,
    HEADER_READ,
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    MAX_GPUS_PER_WORKER,
    MAX_WORKERS,
    MODEL_NAME_BYTES,
    RUN_DIR_OFFSET,
    SLOT_SIZE,
    SegmentHeader,
    check_not_foreign,
    decode_header,
    encode_run_dir,
    resolve_path,
    segment_size,
)


def create_file(path: str, num_workers: int, *, state_interval_ms: int, model: str, gpu_map: list[list[int]] | None,
                mode: int, replace: bool, run_dir: str) -> None:
    """Create the segment file at ``path`` for ``num_workers`` workers (module docstring); the arguments are
    :meth:`dplb.state.shm.Segment.create`'s. Raises ``ValueError`` for bad arguments, :class:`ShmError` for a path
    that is not a DPLB segment, ``FileExistsError`` for an existing one without ``replace``,
    :class:`ShmCreateError` when the directory is missing or not writable, :class:`ShmSpaceError` when the
    filesystem has no room."""
    if not 1 <= num_workers <= MAX_WORKERS:
        raise ValueError(f"num_workers must be 1..{MAX_WORKERS}, got {num_workers}")
    if not 1 <= state_interval_ms <= MAX_STATE_INTERVAL_MS:
        raise ValueError(f"state_interval_ms must be 1..{MAX_STATE_INTERVAL_MS}, got {state_interval_ms}")
    gmap = gpu_map or [[] for _ in range(num_workers)]
    if len(gmap) != num_workers:
        raise ValueError(f"gpu_map has {len(gmap)} entries for {num_workers} workers")
    for g in gmap:
        if len(g) > MAX_GPUS_PER_WORKER or any(not 0 <= i < 256 for i in g):
            raise ValueError(f"gpu_map entry {g} must hold at most {MAX_GPUS_PER_WORKER} indices 0..255")
    model_b = model.encode()[:MODEL_NAME_BYTES]
    run_dir_b = encode_run_dir(run_dir)
    check_not_foreign(path)
    if not replace and os.path.exists(path):
        raise FileExistsError(f"segment '{path}' already exists (use replace=True to take it over)")
    size = segment_size(num_workers)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
        raise ShmCreateError(path, e) from e
    try:
        os.fchmod(fd, mode)  # umask-proof
        try:
            os.posix_fallocate(fd, 0, size)  # tmpfs: really reserve pages, so a full fs fails here, not SIGBUS
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise ShmSpaceError(path, size, os.strerror(e.errno)) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)
        buf = bytearray(HEADER_SIZE)
        HEADER.pack_into(
            buf, 0, MAGIC, LAYOUT_VERSION, HEADER_SIZE, num_workers, SLOT_SIZE, state_interval_ms,
            time.time_ns(), os.getpid(), 0, model_b,
        )
        for w, g in enumerate(gmap):
            GPU_ENTRY.pack_into(buf, GPU_MAP_OFFSET + 16 * w, len(g), bytes(g))
        buf[RUN_DIR_OFFSET:RUN_DIR_OFFSET + len(run_dir_b)] = run_dir_b
        os.pwrite(fd, bytes(buf), 0)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)


def map_file(path: str | None, *, writable: bool) -> tuple[str, int, mmap.mmap, SegmentHeader, int]:
    """Open the segment at ``path`` (or ``$DPLB_SHM_PATH``), validate its header and map it whole (read-write when
    ``writable``). Returns ``(path, fd, mapping, header, inode)``: the caller owns the descriptor and the mapping.

    Raises :class:`ShmMissingError` (no file), :class:`ShmLayoutError` (wrong magic/version/size, not a regular
    file), :class:`ShmError` (a directory, no permission)."""
    p = resolve_path(path)
    with contextlib.suppress(OSError):
        st_mode = os.stat(p).st_mode
        if stat.S_ISDIR(st_mode):
            raise ShmPathError(f"segment path '{p}' is a directory, not a DPLB segment; set DPLB_SHM_PATH (or pass "
                               "--shm-path) to the segment file `dplb launch` created (ls /dev/shm | grep dplb_state_)",
                               p)
        if not stat.S_ISREG(st_mode):  # a device or FIFO: never opened (a FIFO would block)
            raise ShmLayoutError(p, "not a regular file", dplb_magic=False)
    try:
        fd = os.open(p, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError as e:
        raise ShmMissingError(p) from e
    except PermissionError as e:
        raise ShmError(
            f"no permission to open DPLB segment '{p}' ({e.strerror}); run as the user/group that owns it "
            "(systemd: the dplb user) or fix its mode.",
            p,
        ) from e
    try:
        st = os.fstat(fd)
        raw = os.pread(fd, HEADER_READ, 0)
        if st.st_size < HEADER_SIZE:
            raise ShmLayoutError(p, f"file is {st.st_size} bytes, smaller than the {HEADER_SIZE}-byte header",
                                 dplb_magic=raw[:4] == MAGIC)
        header = decode_header(p, raw, st.st_size)
        mm = mmap.mmap(
            fd, segment_size(header.num_workers),
            access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ,
        )
    except BaseException:
        os.close(fd)
        raise
    return p, fd, mm, header, st.st_ino


def restore_header(mm: mmap.mmap, header: SegmentHeader, model: str, gpu_map: list[list[int]],
                   run_dir: str) -> list[str]:
    """Write ``model``, ``gpu_map`` (its first ``header.num_workers`` entries) and ``run_dir`` into the header of
    the writable mapping ``mm`` where ``header`` (its decoded header) has them empty; nothing else is written.
    Returns the names of the fields written (``"model"``, ``"GPU map"``, ``"run dir"``)."""
    done: list[str] = []
    if model and not header.model:
        b, off = model.encode()[:MODEL_NAME_BYTES], HEADER.size - MODEL_NAME_BYTES
        mm[off:off + len(b)] = b
        done.append("model")
    if any(gpu_map) and not any(header.gpu_map):
        for w, g in enumerate(gpu_map[: header.num_workers]):
            GPU_ENTRY.pack_into(mm, GPU_MAP_OFFSET + 16 * w, len(g), bytes(g))
        done.append("GPU map")
    if run_dir and not header.run_dir:
        b = encode_run_dir(run_dir)
        mm[RUN_DIR_OFFSET:RUN_DIR_OFFSET + len(b)] = b
        done.append("run dir")
    return done


__all__ = ["create_file", "map_file", "restore_header"]
