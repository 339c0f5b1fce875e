"""Shared-memory state plane: workers publish their live state, the router reads it (docs/DESIGN.md §3).

The segment is a plain file under ``/dev/shm`` (tmpfs), mapped with :mod:`mmap`. We deliberately do not use
``multiprocessing.shared_memory``: its resource tracker unlinks a segment when *any* attached process exits.
The full path is handed to every process as ``DPLB_SHM_PATH``. Mode 0600 unless a group mode is asked for.

Byte layout (little-endian; offsets in bytes)::

    Header, HEADER_SIZE = 4096 bytes (one page), written once by the creator (except the router registry, and the
    model, GPU map and run dir when empty: ``dplb launch`` restores them into a segment recreated at its path)
      0   4s   magic                 b"DPLB"
      4   u16  layout_version        LAYOUT_VERSION (dplb.state.layout, with the history of the versions)
      6   u16  header_size           4096
      8   u16  num_workers           1..MAX_WORKERS (64)
      10  u16  slot_size             SLOT_SIZE (192)
      12  u32  state_interval_ms     how often workers publish (default 200)
      16  u64  created_unix_ns       creation time, CLOCK_REALTIME ns
      24  u32  creator_pid
      28  u32  reserved (0)
      32  128s model                 UTF-8, NUL-padded (served model name; may be empty)
      160 64 × 16 bytes GPU map      per worker w at 160 + 16·w: u8 count (0..15), then 15 × u8 GPU indices
      1184 16 × 8 bytes routers      u32 pid, u16 TCP port, u16 reserved (0 pid = free); written by each router
                                     process under flock (dplb.state.layout.register_router), cleared when it stops;
                                     entry r owns router slot r
      1312 256s run_dir              UTF-8, NUL-padded: the run directory of the worker sockets (may be empty)
      1568..4095 reserved (zeros)

    Slot w at HEADER_SIZE + w·SLOT_SIZE (64-byte cache-line aligned), written only by worker w
      0   u64  seq                   seqlock counter: odd while the writer is mid-update
      8   u32  pid                   0 = slot never written
      12  u8   lifecycle             Lifecycle enum (0 unset, 1 starting, 2 warming, 3 ready, 4 draining, 5 stopped)
      13  u8   flags                 bit0 NO_GPU (NVML absent: memory fields are 0), bit1 GPU_BUSY, bit2 STALLED
                                     (the worker's own stall check, dplb.policy.stall, with the router's
                                     --stall-after: requests in flight and no engine progress; set until it moves),
                                     bit3 PREV_STOPPED (the slot's previous process, another pid, had published
                                     stopped when this one claimed the slot: it left by itself)
      14  u16  max_loras             LoRA adapters one batch can hold (vLLM --max-loras; 0 = LoRA off or unknown)
      16  u64  heartbeat_mono_ns     CLOCK_MONOTONIC ns at publish (system-wide on Linux; used for staleness)
      24  u64  heartbeat_unix_ns     CLOCK_REALTIME ns at publish (for humans and metrics)
      32  u32  num_running           engine requests running (decode/prefill batch)
      36  u32  num_waiting           engine requests queued
      40  u32  max_num_seqs          engine batch cap (0 = unknown)
      44  u32  last_prompt_tokens    prompt length of the last request
      48  f64  kv_cache_usage        fraction 0–1 of KV-cache blocks in use
      56  u64  gpu_memory_used_bytes NVML, summed over the worker's GPUs
      64  u64  gpu_memory_total_bytes
      72  f64  avg_latency_s         mean E2E latency of the last 10 requests, seconds (0 = none yet)
      80  f64  avg_ttft_s            mean TTFT of the last 10 requests, seconds (0 = none yet)
      88  u64  requests_total
      96  u64  errors_total          requests the engine failed (5xx, or cut short by the engine; a client's
                                     disconnect is not one)
      104 u64  cuda_oom_total
      112 f64  warmup_seconds        duration of the warm-up request (0 until warmed)
      120 f64  first_request_seconds duration of the first real request after ready (0 until served)
      128 u64  started_unix_ns       worker process start (a change means the worker restarted)
      136 f64  model_load_seconds    engine load (process start of the engine → engine up), seconds (0 until loaded)
      144 u32  kv_total_blocks       KV-cache capacity in blocks (vLLM: cache_config.num_gpu_blocks; 0 = unknown)
      148 u32  kv_block_size         tokens per KV-cache block (vLLM: cache_config.block_size; 0 = unknown)
      152 u64  progress_total        monotone count of engine progress: tokens generated + prompt tokens prefilled +
                                     engine iterations finished (vLLM: its own counters; sim: scheduler steps); only
                                     its changes matter (the router's stall check, docs/DESIGN.md §6)
      160 u64  progress_mono_ns      CLOCK_MONOTONIC ns of the publish that first saw progress_total at its value
      168 u64  last_done_mono_ns     CLOCK_MONOTONIC ns at which the last latency sample (a completed request) was
                                     taken (0 = none yet): how old ``avg_latency_s``/``avg_ttft_s`` are (the latency
                                     term's freshness, dplb/policy/scorers.py)
      176..191 reserved (zeros)

    Router slots: 16 × 3136 bytes after the last worker slot, at HEADER_SIZE + num_workers·SLOT_SIZE, one per router
    process (its per-worker in-flight correction and in-flight count, and its health table: the workers it ejected,
    its failure streaks), then 16 prefix rings of 65600 bytes (the prefix blocks each router process's index learnt,
    replayed by the others); layout in :mod:`dplb.state.router_slots` and :mod:`dplb.state.health_board`.
    Then a KV-event ring per worker (:mod:`dplb.state.kv_rings`), a response-id ring per router slot
    (:mod:`dplb.state.response_rings`) and a tenant table per router slot (:mod:`dplb.state.tenant_tables`);
    offsets and the segment's size in :mod:`dplb.state.layout`.

Seqlock protocol. Writer: ``seq += 1`` (odd), write the body, ``seq += 1`` (even). Reader: load ``seq`` (retry if
odd), copy the slot in one slice, load ``seq`` again; retry if it changed; after ``READ_RETRIES`` failed tries the
slot is reported as torn (the caller treats it as stale). Seq words are loaded and stored as single aligned 8-byte
accesses through a ``memoryview.cast("Q")`` — never with ``struct.pack_into``, which zero-fills its target first
and would make the seq transiently 0. Each store is a separate C call, so stores are issued in program order, and
x86-64's TSO keeps that order for other cores. There is exactly one writer per slot, so the writer needs no lock.

Staleness: a slot whose heartbeat is older than ``3 × state_interval_ms`` is stale (not routable).

The decoded slot (:class:`WorkerState`, :class:`Lifecycle`, the flag bits, the staleness rule) is
:mod:`dplb.state.worker_state`, re-exported here; making, validating and mapping the file (and restoring empty header
fields) is :mod:`dplb.state.segment_file`'s. This module owns the slots' bytes: the layout, the seqlock reads and
writes, and the :class:`Segment` object that holds the mapping.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from typing import Any, Final

from dplb.errors import ShmWorkerIdError
from dplb.state.layout import (
    ENV_SHM_PATH,
    HEADER_READ,
    HEADER_SIZE,
    MAX_WORKERS,
    SEGMENT_PREFIX,
    SHM_DIR,
    SLOT_SIZE,
    SegmentHeader,
    decode_header,
    default_segment_path,
    list_segments,
    resolve_path,
    segment_size,
)
from dplb.state.segment_file import create_file, map_file, restore_header
from dplb.state.worker_state import (
    FLAG_GPU_BUSY,
    FLAG_NO_GPU,
    FLAG_PREV_STOPPED,
    FLAG_STALLED,
    STALE_INTERVALS,
    Lifecycle,
    WorkerState,
)

READ_RETRIES: Final = 64

# Slot body without seq: from offset 8 to 176.
_BODY: Final = struct.Struct("<IBBHQQIIIIdQQddQQQddQdIIQQQ")
_SLOT: Final = struct.Struct("<Q" + _BODY.format[1:])  # seq + body, for one-slice decoding
assert _SLOT.size == 176 <= SLOT_SIZE and SLOT_SIZE % 64 == 0


class Segment:
    """An open (mapped) state segment. Create with :meth:`create`, open with :meth:`attach`.

    The object owns one mmap and one file descriptor; :meth:`close` releases both (the file stays).
    :meth:`unlink` removes the file. Thread-safe for readers; each slot must have exactly one writer.
    """

    def __init__(self, path: str, fd: int, mm: mmap.mmap, header: SegmentHeader, inode: int) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self.header = header
        self.inode = inode
        self.num_workers = header.num_workers
        self.state_interval_ms = header.state_interval_ms
        self._view = memoryview(mm)
        # Seq words are read and written through a uint64 view: one aligned 8-byte load/store each.
        # (struct.pack_into zero-fills its target before packing, so it must never write a seq word: a reader
        # could see the transient 0 twice and accept a torn body.)
        self._seqs = self._view.cast("Q")
        self._seq_idx = [(HEADER_SIZE + k * SLOT_SIZE) >> 3 for k in range(header.num_workers)]
        # Every slot's seq word, one per slot (a strided view: ``tolist()`` loads them all in one call).
        first = HEADER_SIZE >> 3
        self._slot_seqs = self._seqs[first : first + header.num_workers * (SLOT_SIZE >> 3) : SLOT_SIZE >> 3]
        # What the last read_all decoded: the (even) seq each slot was read at (-1: not kept, torn) and its state;
        # one attribute, replaced whole, so that concurrent readers never pair a seq with another read's state.
        self._last: tuple[list[int], list[WorkerState]] = ([-1] * header.num_workers, [])
        self._kv: Any = None  # this process's KV-ring reader (dplb.state.kv_rings), made on first use

    # ---- lifecycle -------------------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str,
        num_workers: int,
        *,
        state_interval_ms: int = 200,
        model: str = "",
        gpu_map: list[list[int]] | None = None,
        mode: int = 0o600,
        replace: bool = False,
        run_dir: str = "",
    ) -> Segment:
        """Create a segment file at ``path`` and map it (:func:`dplb.state.segment_file.create_file`).

        The file is written under a temporary name in the same directory and renamed into place, so a reader
        never sees a half-written header. ``replace=True`` atomically replaces an existing file (e.g. a segment
        left by a crashed launcher) — but only a DPLB segment: a directory or any other file raises
        :class:`ShmError` and is left untouched; otherwise an existing file raises :class:`FileExistsError`.
        ``run_dir`` (the sockets' directory) is recorded for ``dplb state``/``dplb doctor``.
        Raises :class:`ShmSpaceError` when the filesystem has no room, ``ValueError`` for bad arguments.
        """
        create_file(path, num_workers, state_interval_ms=state_interval_ms, model=model, gpu_map=gpu_map, mode=mode,
                    replace=replace, run_dir=run_dir)
        return cls.attach(path)

    @classmethod
    def attach(cls, path: str | None = None, *, writable: bool = True) -> Segment:
        """Map an existing segment (``path`` or ``$DPLB_SHM_PATH``) and validate its header.

        Raises :class:`ShmMissingError` (no file), :class:`ShmLayoutError` (wrong magic/version/size, not a regular
        file), :class:`ShmError` (a directory, no permission).
        """
        return cls(*map_file(path, writable=writable))

    def close(self) -> None:
        """Unmap and close. Idempotent. The file is kept."""
        if self._fd < 0:
            return
        if self._kv is not None:
            self._kv.close()
        self._slot_seqs.release()
        self._seqs.release()
        self._view.release()
        with contextlib.suppress(BufferError):  # a live memoryview elsewhere; the GC will unmap
            self._mm.close()
        os.close(self._fd)
        self._fd = -1

    def unlink(self) -> bool:
        """Remove the file if it is still this segment (same inode). Idempotent. Returns True when it removed it."""
        try:
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
                return True
        except FileNotFoundError:
            pass
        return False

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def still_present(self) -> bool:
        """True if ``path`` still names this segment (not deleted or replaced). Does a ``stat``: not hot-path."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def restore_header(self, model: str, gpu_map: list[list[int]], run_dir: str) -> list[str]:
        """Fill the header fields that are empty (a segment ``dplb segment create`` recreated lacks the GPU map, and
        the model and run dir unless given) with ``model``, ``gpu_map``, ``run_dir``; other fields are never touched.
        Re-reads :attr:`header`; returns the names of the fields written. Needs a writable mapping."""
        done = restore_header(self._mm, self.header, model, gpu_map, run_dir)
        self.reload_header()
        return done

    def reload_header(self) -> None:
        """Decode :attr:`header` again from the mapping (fields filled in after this process attached)."""
        self.header = decode_header(self.path, bytes(self._mm[:HEADER_READ]), len(self._mm))

    # ---- reading ---------------------------------------------------------------------------------------------
    def read(self, worker_id: int) -> WorkerState:
        """Consistent copy of slot ``worker_id`` (seqlock). A slot torn ``READ_RETRIES`` times has ``torn=True``."""
        off = self._slot_offset(worker_id)
        mm = self._mm
        seqs = self._seqs
        si = off >> 3
        for _ in range(READ_RETRIES):
            seq = seqs[si]  # one aligned 8-byte load, before the copy
            if seq & 1:
                continue
            raw = mm[off : off + _SLOT.size]
            if seqs[si] != seq:  # and one after it
                continue
            v = _SLOT.unpack(raw)
            return WorkerState(
                worker_id, v[1], _LIFECYCLES[v[2]] if v[2] < len(_LIFECYCLES) else Lifecycle.UNSET, v[3],
                v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15], v[16], v[17], v[18],
                v[19], v[20], v[21], v[22], v[23], v[24], v[25], v[26], v[4], v[27], seq,
            )
        return WorkerState(worker_id, torn=True)

    def read_all(self) -> list[WorkerState]:
        """Consistent copies of every slot, in worker-id order (the router's per-request snapshot).

        One load of every seq word; a slot whose seq is the one it had at the last call is unchanged (every write
        makes it odd, then larger) and its state is the one decoded then: the returned :class:`WorkerState` objects
        are shared between calls, so treat them as read-only. The changed slots are decoded from one copy of the
        slot area between two passes over the seq words; a slot whose seq was odd or moved during the copy is
        re-read alone with :meth:`read` (same seqlock guarantee, fewer calls when quiet)."""
        before = self._slot_seqs.tolist()
        last_seqs, last = self._last
        if before == last_seqs:  # nothing was written since the last call (the usual case: a write per interval)
            return last[:]
        n = self.num_workers
        seqs = self._seqs
        idx = self._seq_idx
        raw = self._mm[HEADER_SIZE : HEADER_SIZE + n * SLOT_SIZE]
        out = []
        unpack = _SLOT.unpack_from
        lifes = _LIFECYCLES
        nl = len(lifes)
        for k in range(n):
            seq = before[k]
            if seq == last_seqs[k]:
                out.append(last[k])
                continue
            if seq & 1 or seqs[idx[k]] != seq:
                w = self.read(k)
                out.append(w)
                before[k] = -1 if w.torn else w.seq
                continue
            v = unpack(raw, k * SLOT_SIZE)
            out.append(WorkerState(
                k, v[1], lifes[v[2]] if v[2] < nl else Lifecycle.UNSET, v[3], v[5], v[6], v[7], v[8], v[9], v[10],
                v[11], v[12], v[13], v[14], v[15], v[16], v[17], v[18], v[19], v[20], v[21], v[22], v[23], v[24],
                v[25], v[26], v[4], v[27], seq,
            ))
        self._last = (before, out)  # before[k]: the seq out[k] was read at
        return out[:]

    def router_slots(self) -> list[dict[str, Any]]:
        """Every used router slot (pid, port, process index, heartbeat age, per-worker pending and in-flight):
        what each router process has sent (:mod:`dplb.state.router_slots`). For display; not seqlocked."""
        from dplb.state.router_slots import read_router_slots

        return read_router_slots(self._mm, self.num_workers)

    def tenant_table(self, slot: int) -> list[dict[str, int | float]]:
        """Router slot ``slot``'s tenant table: its used entries, tag and counters
        (:func:`dplb.state.tenant_tables.read_tenant_table`). For display."""
        from dplb.state.tenant_tables import read_tenant_table

        return read_tenant_table(self._mm, self.num_workers, slot)

    def router_inflight(self, worker_id: int) -> dict[int, int]:
        """``{router pid: requests it has open to worker_id}`` for every live router process on this segment
        (:func:`dplb.state.router_slots.router_inflight`; seqlocked)."""
        from dplb.state.router_slots import router_inflight

        self._slot_offset(worker_id)  # raises ShmWorkerIdError for a worker outside the segment
        return router_inflight(self._mm, self._seqs, self.num_workers, worker_id)

    def kv_reader(self) -> Any:
        """This process's :class:`dplb.state.kv_rings.KvRingReader` of every worker's KV ring (one per segment
        object; its cursors start at what the rings hold now)."""
        if self._kv is None:
            from dplb.state.kv_rings import KvRingReader

            self._kv = KvRingReader(self._mm, self.num_workers)
        return self._kv

    # ---- writing ---------------------------------------------------------------------------------------------
    def kv_writer(self, worker_id: int) -> Any:
        """The single writer of worker ``worker_id``'s KV ring (:class:`dplb.state.kv_rings.KvRingWriter`)."""
        from dplb.state.kv_rings import KvRingWriter

        self._slot_offset(worker_id)
        return KvRingWriter(self._mm, self.num_workers, worker_id)

    def writer(self, worker_id: int) -> SlotWriter:
        """The single writer of slot ``worker_id``."""
        return SlotWriter(self, worker_id)

    def _slot_offset(self, worker_id: int) -> int:
        if not 0 <= worker_id < self.num_workers:
            raise ShmWorkerIdError(
                f"worker id {worker_id} is outside this segment's 0..{self.num_workers - 1} "
                f"('{self.path}' was created for {self.num_workers} workers); recreate it with more workers.",
                self.path,
            )
        return HEADER_SIZE + worker_id * SLOT_SIZE


_LIFECYCLES: Final = list(Lifecycle)



class SlotWriter:
    """Writes one worker's slot with the seqlock protocol. Exactly one per slot (one process, one thread)."""

    def __init__(self, segment: Segment, worker_id: int) -> None:
        self.segment = segment
        self.worker_id = worker_id
        self._off = segment._slot_offset(worker_id)
        self._si = self._off >> 3
        self._seq = segment._seqs[self._si]
        if self._seq & 1:  # a previous writer died mid-update: make it even again before the next write
            self._seq += 1

    def publish(self, state: WorkerState) -> None:
        """Write every field of ``state`` (its ``worker_id``, ``seq`` and ``torn`` are ignored).

        Heartbeat fields are written as given; use :meth:`publish_now` to stamp the current clocks.
        """
        mm = self.segment._mm
        seqs = self.segment._seqs
        off = self._off
        seq = self._seq + 1
        seqs[self._si] = seq  # odd: update in progress
        _BODY.pack_into(
            mm, off + 8, state.pid, int(state.lifecycle), state.flags, min(0xFFFF, max(0, state.max_loras)),
            state.heartbeat_mono_ns,
            state.heartbeat_unix_ns, state.num_running, state.num_waiting, state.max_num_seqs,
            state.last_prompt_tokens, state.kv_cache_usage, state.gpu_memory_used_bytes,
            state.gpu_memory_total_bytes, state.avg_latency_s, state.avg_ttft_s, state.requests_total,
            state.errors_total, state.cuda_oom_total, state.warmup_seconds, state.first_request_seconds,
            state.started_unix_ns, state.model_load_seconds, state.kv_total_blocks, state.kv_block_size,
            state.progress_total, state.progress_mono_ns, state.last_done_mono_ns,
        )
        seq += 1
        seqs[self._si] = seq  # even: consistent again
        self._seq = seq

    def publish_now(self, state: WorkerState) -> None:
        """Stamp ``state``'s heartbeat with the current monotonic and wall clocks, then :meth:`publish`."""
        state.heartbeat_mono_ns = time.monotonic_ns()
        state.heartbeat_unix_ns = time.time_ns()
        self.publish(state)

    def clear(self) -> None:
        """Zero the slot (pid 0 = unregistered)."""
        self.publish(WorkerState(self.worker_id))


__all__ = [
    "ENV_SHM_PATH", "FLAG_GPU_BUSY", "FLAG_NO_GPU", "FLAG_PREV_STOPPED", "FLAG_STALLED", "MAX_WORKERS",
    "SEGMENT_PREFIX", "SHM_DIR",
    "STALE_INTERVALS",
    "Lifecycle", "Segment", "SegmentHeader", "SlotWriter", "WorkerState", "default_segment_path", "list_segments",
    "resolve_path", "segment_size",
]
