"""docs/DESIGN.md cannot drift from the code: its shared-memory tables (§3) are checked against the struct formats
and constants of dplb/state/{layout,shm,router_slots,kv_rings,response_rings,tenant_tables}.py and, field by field, against bytes
the real writers put into a real segment; every ``docs/DESIGN.md §N`` cited in the repository names a section that
exists, and nothing cites the design by a bare "DESIGN §N" (a document outside the repository).
"""

from __future__ import annotations

import os
import re
import struct
import time
from pathlib import Path

import pytest

from dplb.state import layout
from dplb.state import shm as shm_mod
from dplb.state.router_slots import ROUTER_ENTRY, ROUTER_HEAD, RouterSlots, routers_offset
from dplb.state.shm import Lifecycle, Segment, WorkerState

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "DESIGN.md"
_CODES = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q", "f64": "d"}


def doc_table(name: str) -> list[dict[str, str]]:
    """The rows of the table between ``<!-- table:NAME -->`` and ``<!-- end -->`` in docs/DESIGN.md, as dicts keyed
    by the header cells."""
    text = DOC.read_text()
    m = re.search(rf"<!-- table:{re.escape(name)} -->\n(.*?)<!-- end -->", text, re.S)
    assert m, f"docs/DESIGN.md has no table '{name}'"
    lines = [ln.strip() for ln in m.group(1).strip().splitlines()]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    head = cells[0]
    return [dict(zip(head, row, strict=True)) for row in cells[2:]]


def struct_code(doc_type: str) -> str:
    """The struct code of a type cell: ``u16`` → ``H``, ``128s`` → ``128s``."""
    if doc_type in _CODES:
        return _CODES[doc_type]
    assert re.fullmatch(r"\d+s", doc_type), f"unknown type '{doc_type}' in docs/DESIGN.md"
    return doc_type


def check_layout(rows: list[dict[str, str]], fmt: str) -> None:
    """The rows' types, in order, are exactly ``fmt`` and each offset is where ``struct`` puts that field."""
    codes = [struct_code(r["type"]) for r in rows]
    assert "<" + "".join(codes) == fmt, f"docs/DESIGN.md types {codes} differ from the code's format {fmt!r}"
    for i, r in enumerate(rows):
        want = struct.calcsize("<" + "".join(codes[:i]))
        assert int(r["offset"]) == want, f"docs/DESIGN.md: {r['field']} at {r['offset']}, the code puts it at {want}"


def field_bytes(raw: bytes, base: int, row: dict[str, str]) -> object:
    """The value of one documented field read from ``raw`` at ``base`` + its documented offset."""
    return struct.unpack_from("<" + struct_code(row["type"]), raw, base + int(row["offset"]))[0]


def test_header_table_matches_code_and_bytes(shm_path: str) -> None:
    rows = doc_table("header")
    check_layout(rows, layout.HEADER.format)
    seg = Segment.create(shm_path, 3, state_interval_ms=123, model="m-x")
    try:
        raw = Path(shm_path).read_bytes()
        want = {"magic": layout.MAGIC, "layout_version": layout.LAYOUT_VERSION, "header_size": layout.HEADER_SIZE,
                "num_workers": 3, "slot_size": layout.SLOT_SIZE, "state_interval_ms": 123,
                "created_unix_ns": seg.header.created_unix_ns, "creator_pid": os.getpid(), "reserved": 0,
                "model": b"m-x".ljust(layout.MODEL_NAME_BYTES, b"\0")}
        assert [r["field"] for r in rows] == list(want)
        for r in rows:
            assert field_bytes(raw, 0, r) == want[r["field"]], r["field"]
    finally:
        seg.close()


def _region_size(cell: str) -> int:
    if m := re.fullmatch(r"(\d+) × (\d+) bytes", cell):
        return int(m.group(1)) * int(m.group(2))
    if m := re.fullmatch(r"(\d+)s|(\d+) bytes", cell):
        return int(m.group(1) or m.group(2))
    raise AssertionError(f"unknown region size '{cell}'")


def test_header_regions_match_constants_and_bytes(shm_path: str) -> None:
    rows = doc_table("header-regions")
    offsets = {"gpu_map": layout.GPU_MAP_OFFSET, "routers": layout.ROUTERS_OFFSET, "run_dir": layout.RUN_DIR_OFFSET,
               "reserved": layout.HEADER_READ}
    sizes = {"gpu_map": layout.MAX_WORKERS * layout.GPU_ENTRY.size,
             "routers": layout.MAX_ROUTERS * layout.ROUTER_ENTRY.size, "run_dir": layout.RUN_DIR_BYTES,
             "reserved": layout.HEADER_SIZE - layout.HEADER_READ}
    assert [r["field"] for r in rows] == list(offsets)
    assert int(rows[0]["offset"]) == layout.HEADER.size
    for r, nxt in zip(rows, [*rows[1:], None], strict=True):
        assert int(r["offset"]) == offsets[r["field"]], r["field"]
        assert _region_size(r["type"]) == sizes[r["field"]], r["field"]
        end = int(nxt["offset"]) if nxt else layout.HEADER_SIZE
        assert int(r["offset"]) + sizes[r["field"]] == end, f"{r['field']} does not end where the next region starts"
    assert layout.GPU_ENTRY.format == f"<B{layout.MAX_GPUS_PER_WORKER}s" and layout.ROUTER_ENTRY.format == "<IHH"
    seg = Segment.create(shm_path, 2, gpu_map=[[4, 5], [7]], run_dir="/run/dplb-doc")
    try:
        assert layout.register_router(shm_path, 4321, pid=os.getpid()) == 0
        raw = Path(shm_path).read_bytes()
        assert raw[160:163] == bytes([2, 4, 5]) and raw[176:178] == bytes([1, 7])  # w at 160 + 16·w: count, indices
        assert struct.unpack_from("<IHH", raw, 1184) == (os.getpid(), 4321, 0)
        assert raw[1312:1312 + 256].rstrip(b"\0") == b"/run/dplb-doc"
        assert raw[1568:4096] == bytes(4096 - 1568)
    finally:
        layout.unregister_router(shm_path, os.getpid())
        seg.close()


def test_worker_slot_table_matches_code_and_bytes(shm_path: str) -> None:
    rows = doc_table("worker-slot")
    check_layout(rows, shm_mod._SLOT.format)
    seg = Segment.create(shm_path, 2)
    try:
        fields = [f for f in WorkerState.__dataclass_fields__ if f not in ("worker_id", "seq", "torn")]
        state = WorkerState(1)
        for i, name in enumerate(fields):  # a distinct value per field, so a swapped offset cannot pass
            if name == "lifecycle":
                state.lifecycle = Lifecycle.DRAINING
            elif name == "flags":
                state.flags = shm_mod.FLAG_GPU_BUSY
            elif name == "kv_cache_usage":
                state.kv_cache_usage = 0.625
            elif isinstance(getattr(state, name), float):
                setattr(state, name, 1.5 + i)
            else:
                setattr(state, name, 1000 + i)
        seg.writer(1).publish(state)
        raw = Path(shm_path).read_bytes()
        base = layout.HEADER_SIZE + layout.SLOT_SIZE
        documented = {r["field"] for r in rows} - {"seq", "reserved"}
        assert documented == set(fields), "docs/DESIGN.md worker-slot fields differ from WorkerState's"
        for r in rows:
            got = field_bytes(raw, base, r)
            if r["field"] == "seq":
                assert got == seg.read(1).seq and got % 2 == 0
            elif r["field"] == "reserved":
                assert got == 0
            else:
                assert got == int(getattr(state, r["field"])) if r["type"] != "f64" else got == getattr(
                    state, r["field"]), r["field"]
        assert raw[base + shm_mod._SLOT.size:base + layout.SLOT_SIZE] == bytes(layout.SLOT_SIZE - shm_mod._SLOT.size)
    finally:
        seg.close()


def test_router_slot_and_ring_tables_match_code_and_bytes(shm_path: str) -> None:
    head_rows, entry_rows, ring_rows = doc_table("router-slot"), doc_table("router-entry"), doc_table("prefix-ring")
    # + urgent (one store outside the seqlocked head) and health_gen (the health table's own seqlock)
    check_layout(head_rows, "<Q" + ROUTER_HEAD.format[1:] + "QQ")
    check_layout(entry_rows, ROUTER_ENTRY.format)
    check_layout(ring_rows, "<QQ")
    seg = Segment.create(shm_path, 3)
    slots = RouterSlots.claim(shm_path, 3, port=4321, process_index=1)
    assert slots is not None
    try:
        sent = time.monotonic_ns()
        slots.publish(2, pending=3, inflight=5, sent_now_ns=sent)
        slots.publish_prefix(1, [0x1234, 0x5678])
        slots.publish_urgent(1)
        raw = Path(shm_path).read_bytes()
        base = routers_offset(3) + slots.index * layout.ROUTER_SLOT_SIZE
        got = {r["field"]: field_bytes(raw, base, r) for r in head_rows}
        assert got["seq"] % 2 == 0 and got["seq"] > 0
        assert (got["pid"], got["port"], got["process_index"], got["last_sent_mono_ns"]) == (os.getpid(), 4321, 1,
                                                                                            sent)
        assert 0 < got["heartbeat_mono_ns"] <= time.monotonic_ns()
        assert got["urgent"] == 2  # class 1 queued, + 1
        assert got["health_gen"] % 2 == 0 and got["health_gen"] > 0  # claimed: the table's seqlock, even when idle
        entry = {r["field"]: field_bytes(raw, base + 64 + 16 * 2, r) for r in entry_rows}
        assert entry == {"pending": 3, "inflight": 5, "last_sent_mono_ns": sent}
        ring = routers_offset(3) + layout.MAX_ROUTERS * layout.ROUTER_SLOT_SIZE + slots.index * layout.PREFIX_RING_SIZE
        assert field_bytes(raw, ring, ring_rows[0]) == 2  # head: entries ever written
        assert field_bytes(raw, ring, ring_rows[1]) == 2  # reserve: = head when no append is in progress
        assert struct.unpack_from("<QQ", raw, ring + 64) == (0x1234 | 2 << 56, 0x5678 | 2 << 56)  # key | (w+1) << 56
    finally:
        slots.close()
        seg.close()


def test_kv_ring_table_matches_code_and_bytes(shm_path: str) -> None:
    from dplb.state.kv_rings import KV_HEAD, OP_REMOVED, OP_STORED

    rows = doc_table("kv-ring")
    check_layout(rows, KV_HEAD.format)
    seg = Segment.create(shm_path, 3)
    try:
        w = seg.kv_writer(1)
        w.reset(128)
        w.enable(777)
        w.append(OP_STORED, [0x1234])
        w.append(OP_REMOVED, [0x5678])
        w.compare(cached=40, predicted=50)
        w.lost_batches(2)
        raw = Path(shm_path).read_bytes()
        base = layout.kv_rings_offset(3) + layout.KV_RING_SIZE
        got = {r["field"]: field_bytes(raw, base, r) for r in rows}
        assert got == {"head": 2, "events_since_mono_ns": 777, "compared_total": 1, "cached_tokens_total": 40,
                       "predicted_tokens_total": 50, "error_tokens_total": 10, "block_bytes": 128,
                       "lost_batches": 2, "reserve": 2}
        assert struct.unpack_from("<QQ", raw, base + 64) == (0x1234 | 1 << 56, 0x5678 | 2 << 56)
        assert f"next goes to `head mod {layout.KV_RING_ENTRIES}`" in DOC.read_text()
        w.close()
    finally:
        seg.close()


def test_response_ring_tables_match_code_and_bytes(shm_path: str) -> None:
    from dplb.state.response_rings import RESPONSE_ENTRY, RESPONSE_HEAD, id_key
    from dplb.tenants import tenant_tag

    head_rows, entry_rows = doc_table("response-ring"), doc_table("response-entry")
    check_layout(head_rows, RESPONSE_HEAD.format)
    check_layout(entry_rows, RESPONSE_ENTRY.format)
    seg = Segment.create(shm_path, 3)
    slots = RouterSlots.claim(shm_path, 3, port=4321)
    assert slots is not None
    try:
        from dplb.router.ownership import OwnedResponseIds

        class Ex:  # the creating request's exchange, as the proxy hands it: its tenant's ticket
            tenant = type("Ticket", (), {"tenant": type("Tenant", (), {"name": "chat"})()})()

        OwnedResponseIds(8, lambda: slots.responses).remember("resp_doc", 2, Ex())
        raw = Path(shm_path).read_bytes()
        base = layout.response_rings_offset(3) + slots.index * layout.RESPONSE_RING_SIZE
        got = {r["field"]: field_bytes(raw, base, r) for r in head_rows}
        assert got["head"] == got["reserve"] == 1 and 0 < got["epoch"] <= time.monotonic_ns()
        assert raw[base + RESPONSE_HEAD.size:base + 64] == bytes(64 - RESPONSE_HEAD.size)  # reserved
        entry = {r["field"]: field_bytes(raw, base + 64, r) for r in entry_rows}
        assert entry == {"key": id_key("resp_doc"), "value": 3 << 56 | tenant_tag("chat")}
        assert f"next goes to `head mod {layout.RESPONSE_RING_ENTRIES}`" in DOC.read_text()
    finally:
        slots.close()
        seg.close()


def test_router_health_table_matches_code_and_bytes(shm_path: str) -> None:
    from dplb.state.health_board import HEALTH_ENTRY

    rows = doc_table("router-health")
    check_layout(rows, HEALTH_ENTRY.format)
    seg = Segment.create(shm_path, 3)
    slots = RouterSlots.claim(shm_path, 3, port=4321)
    assert slots is not None
    try:
        slots.health.write(2, until_ns=9_000_000_001, pid=4242, fails=2, streak_ns=8_000_000_002, reset_ns=7_000_000_003)
        raw = Path(shm_path).read_bytes()
        base = routers_offset(3) + slots.index * layout.ROUTER_SLOT_SIZE + layout.HEALTH_TABLE_OFFSET + 32 * 2
        got = {r["field"]: field_bytes(raw, base, r) for r in rows}
        assert got == {"until_mono_ns": 9_000_000_001, "pid": 4242, "fails": 2, "streak_mono_ns": 8_000_000_002,
                       "reset_mono_ns": 7_000_000_003}
        assert "1088 + 32·k (`HEALTH_TABLE_OFFSET`" in DOC.read_text() and layout.HEALTH_TABLE_OFFSET == 1088
    finally:
        slots.close()
        seg.close()


def test_tenant_table_matches_code_and_bytes(shm_path: str) -> None:
    from dplb.tenants import tenant_tag

    rows = doc_table("tenant-entry")
    check_layout(rows, "<" + "Q" * 7)
    seg = Segment.create(shm_path, 3)
    slots = RouterSlots.claim(shm_path, 3, port=4321)
    assert slots is not None
    try:
        tag = tenant_tag("chat")
        e = slots.tenants.assign([tag])[tag]
        slots.tenants.write(e, 2, 7, 900, 40)
        raw = Path(shm_path).read_bytes()
        base = layout.tenant_tables_offset(3) + slots.index * layout.TENANT_TABLE_SIZE + 64 * e
        got = {r["field"]: field_bytes(raw, base, r) for r in rows}
        assert 0 < got.pop("created_mono_ns") <= time.monotonic_ns()
        assert got == {"seq": 4, "key": tag, "inflight": 2, "requests": 7, "tokens_taken": 900, "tokens_given": 40}
        assert raw[base + 56:base + 64] == bytes(8)  # reserved
        assert f"(i < {layout.TENANT_TABLE_ENTRIES}, `TENANT_TABLE_ENTRIES`)" in DOC.read_text()
    finally:
        slots.close()
        seg.close()


def test_segment_map_sizes() -> None:
    text = DOC.read_text()
    h, s, r, p = layout.HEADER_SIZE, layout.SLOT_SIZE, layout.ROUTER_SLOT_SIZE, layout.PREFIX_RING_SIZE
    m = layout.MAX_ROUTERS
    for row in (f"| 0 | {h} |", f"| {h} + {s}·w | {s} |", f"| {h} + {s}·n + {r}·r | {r} |",
                f"| {h} + {s}·n + {m}·{r} + {p}·r | {p} |",
                f"| {h} + {s}·n + {m}·{r} + {m}·{p} + {layout.KV_RING_SIZE}·w | {layout.KV_RING_SIZE} |",
                f"| {h} + {s}·n + {m}·{r} + {m}·{p} + {layout.KV_RING_SIZE}·n + {layout.RESPONSE_RING_SIZE}·r | "
                f"{layout.RESPONSE_RING_SIZE} |",
                f"| {h} + {s}·n + {m}·{r} + {m}·{p} + {layout.KV_RING_SIZE}·n + {m}·{layout.RESPONSE_RING_SIZE} + "
                f"{layout.TENANT_TABLE_SIZE}·r | {layout.TENANT_TABLE_SIZE} |"):
        assert row in text, f"docs/DESIGN.md §3.1 lacks the row starting {row!r}"
    assert f"head mod {layout.PREFIX_RING_ENTRIES}" in text
    assert layout.segment_size(2) == (h + 2 * s + layout.MAX_ROUTERS * (r + p) + 2 * layout.KV_RING_SIZE
                                      + layout.MAX_ROUTERS * (layout.RESPONSE_RING_SIZE + layout.TENANT_TABLE_SIZE))
    assert layout.tenant_tables_offset(2) == layout.response_rings_offset(2) + m * layout.RESPONSE_RING_SIZE
    assert layout.response_rings_offset(2) == h + 2 * s + layout.MAX_ROUTERS * (r + p) + 2 * layout.KV_RING_SIZE


_SECTION = re.compile(r"^##+ (\d+(?:\.\d+)?)\.? ", re.M)
_CITE = re.compile(r"docs/DESIGN\.md`? ((?:§\d+(?:\.\d+)?(?:, | and |; [a-z]+: )?)+)")
_SCANNED = ("dplb", "tests", "benchmarks", "scripts", "dashboards", "alerts", "deploy", "runbooks")


def _repo_texts() -> list[tuple[Path, str]]:
    out = [(ROOT / n, (ROOT / n).read_text()) for n in ("README.md", "pyproject.toml")]
    for d in _SCANNED:
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in (".py", ".md", ".yml", ".toml", ".sh", ".service", ".target", ".txt"):
                out.append((p, p.read_text(errors="replace")))
    return out


def test_every_citation_names_a_section() -> None:
    sections = set(_SECTION.findall(DOC.read_text()))
    assert {str(n) for n in range(1, 13)} <= sections
    cited = 0
    for path, text in _repo_texts():
        for m in _CITE.finditer(text):
            cited += 1
            for n in re.findall(r"§(\d+(?:\.\d+)?)", m.group(1)):
                assert n in sections, f"{path.relative_to(ROOT)} cites docs/DESIGN.md §{n}, which does not exist"
    assert cited >= 20  # the docstrings do cite it


@pytest.mark.parametrize("pattern", [r"(?<!docs/)DESIGN §", r"DESIGN\.md §(?<!docs/DESIGN\.md §)"])
def test_no_citation_outside_the_repository(pattern: str) -> None:
    bad = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
           for p, text in _repo_texts() if p.name != "test_design_doc.py"
           for m in re.finditer(pattern, text)]
    assert not bad, f"cite docs/DESIGN.md §N (the design inside the repository): {bad}"


_METRIC_TOKEN = re.compile(r"\bdplb_[a-z0-9_]*")
#: The series a family exports besides its own name (counters, histograms, info).
_SERIES_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_created", "_info")


def test_every_metric_name_in_the_docs_exists() -> None:
    """Regression: docs/DESIGN.md named ``dplb_upstream_duration_seconds`` and ``dplb_upstream_ttfb_seconds``, which no
    code exports (they are ``dplb_upstream_request_duration_seconds`` and ``dplb_upstream_time_to_first_byte_seconds``).
    Every ``dplb_*`` name in the repository's Markdown (README, DESIGN, runbooks, benchmarks, deploy) is a family of
    dplb/obs/metrics.py (where every name is declared) or one of its series; a name ending in ``_`` is the prefix of
    one; ``dplb_state_*`` is a segment file (dplb.state.layout.SEGMENT_PREFIX), not a metric."""
    from dplb.obs import metrics

    names = {v for v in vars(metrics).values() if isinstance(v, str) and v.startswith("dplb_")}
    assert len(names) >= 50

    def known(token: str) -> bool:
        if token.startswith(layout.SEGMENT_PREFIX):
            return True
        if token.endswith("_"):
            return any(n.startswith(token) for n in names)
        return any(token.endswith(s) and token.removesuffix(s) in names for s in _SERIES_SUFFIXES)

    seen, bad = 0, []
    for path in sorted(ROOT.rglob("*.md")):
        if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue
        for m in _METRIC_TOKEN.finditer(path.read_text()):
            seen += 1
            if not known(m.group()):
                bad.append(f"{path.relative_to(ROOT)}: {m.group()}")
    assert seen >= 50 and not bad, f"not a DPLB metric (dplb/obs/metrics.py): {bad}"
