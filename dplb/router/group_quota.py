"""A tenant's limits for the router group as a whole: this process's share of the segment's tenant tables
(docs/DESIGN.md §15, the byte layout and protocol in :mod:`dplb.state.tenant_tables`).

Contract
- Only *limited* tenants (``requests_per_s``, ``tokens_per_min`` or ``max_concurrent`` set) have an entry; the gate
  calls nothing here for the others.
- :meth:`GroupQuota.sync` (at admission, before the checks): with live peers on the segment, their open requests of
  the tenant (added to this process's own for ``max_concurrent``) and, debited from this process's buckets
  (:meth:`dplb.router.limits.TenantLimits.debit`), what they admitted and took since this process last looked. So
  each process's buckets see the group's consumption and the group admits the configured rate. Only called when
  :meth:`GroupQuota.grouped`.
- Race bound: two processes that admit the same tenant in the same instant each miss the other's admission, so the
  group may admit one request (and its token reservation) more per peer per instant, and hold one more open
  request per peer than ``max_concurrent``; the next admission anywhere sees them.
- A tenant without an entry (more than :data:`dplb.state.layout.TENANT_TABLE_ENTRIES` limited tenants) falls back to
  per-process limits divided by the group's size N (live peers + 1): ``scale`` N, one WARNING per tenant.
- :meth:`GroupQuota.grouped`: whether the gate calls the rest for a tenant now (a limited tenant, and live peers on
  the segment); a process alone calls nothing more: it reads and writes nothing.
- :meth:`GroupQuota.publish`: this process's open requests of the tenant and its monotonic counters (admitted
  requests; tokens taken, given back) into its own entry; called at admission, on a refund and when the request
  ends, while there are peers. Whenever the peer list was refreshed since the last call (every monitor tick,
  ≤ 0.5 s: :meth:`dplb.state.router_slots.RouterSlots.refresh_peers` makes a new list) every entry is written
  again with the open counts of the gate (``active``), so a process that joins reads true open counts from the
  first admission or end of a limited tenant's request after the monitor saw it (≤ 0.5 s). Admissions made while
  alone are not counted.
- :meth:`GroupQuota.configure` (start, reload): the limited tenants; their entries are (re)assigned at the next
  use, and again whenever the router slot changes (the segment re-attached: fresh entries).
- :func:`group_limits_note`: the one line that says all this to an operator (a group's router processes when they
  load the tenants file, ``dplb tenants check``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dplb.router.limits import TenantLimits
from dplb.state.layout import TENANT_TABLE_ENTRIES
from dplb.tenants import Tenant, TenantsConfig, tenant_tag

if TYPE_CHECKING:
    from dplb.router.state import RouterState
    from dplb.state.router_slots import RouterSlots
    from dplb.state.tenant_tables import TenantTables

log = logging.getLogger("dplb.router.tenants")


def limited(t: Tenant) -> bool:
    """True when the tenant has a limit the group shares."""
    return t.max_concurrent is not None or bool(t.requests_per_s) or bool(t.tokens_per_min)


def group_limits_note(processes: int, tc: TenantsConfig) -> str | None:
    """One line for an operator: ``tc``'s limits are enforced for the ``processes`` router processes as a whole,
    with the overshoot bound and the fallback past :data:`TENANT_TABLE_ENTRIES` limited tenants (module docstring).
    None for a single process or a file without a limited tenant."""
    n = sum(limited(t) for t in tc.tenants)
    if processes <= 1 or not n:
        return None
    over = n - TENANT_TABLE_ENTRIES
    past = (f"{over} of the {n} limited tenants are past the segment's {TENANT_TABLE_ENTRIES} shared entries: their "
            f"limits are divided by {processes} per process instead" if over > 0 else
            f"past {TENANT_TABLE_ENTRIES} limited tenants the rest would get their limits divided by {processes}")
    return (f"tenant limits are enforced group-wide across the {processes} router processes ({n} limited "
            f"tenant{'' if n == 1 else 's'}): processes admitting one tenant in the same instant may let one request "
            f"per peer through beyond a limit; {past}")


class GroupQuota:
    """This process's entries in its router slot's tenant table and its reads of the peers' (module docstring)."""

    def __init__(self, state: RouterState, active: dict[str, int]) -> None:
        self.state = state
        self.active = active  # the gate's open requests per tenant (this process)
        #: Limited tenant name → tag (the tenants the group shares).
        self.tags: dict[str, int] = {}
        self._peers_seen: list[int] | None = None
        self._table: TenantTables | None = None
        self._stale = True  # the tenants changed since the entries were assigned
        self._entry: dict[str, int] = {}
        self._counts: dict[str, list[int]] = {}  # name → [requests, tokens taken, tokens given] in this table
        self._warned: set[str] = set()

    def configure(self, tc: TenantsConfig) -> None:
        """The limited tenants of ``tc`` (entries assigned at the next use)."""
        self.tags = {t.name: tenant_tag(t.name) for t in tc.tenants if limited(t)}
        self._stale = True

    def grouped(self, t: Tenant) -> bool:
        """True when ``t`` is limited and this process has live peers (the gate's guard: module docstring)."""
        slots = self.state.slots
        return slots is not None and slots.has_peers and t.name in self.tags

    def _entries(self, slots: RouterSlots) -> dict[str, int]:
        table = slots.tenants
        if table is not self._table or self._stale:
            if table is not self._table:
                self._counts.clear()  # a new slot: its entries start from zero
            got = table.assign(self.tags.values())
            self._entry = {n: got[tag] for n, tag in self.tags.items() if tag in got}
            self._counts = {n: self._counts.get(n, [0, 0, 0]) for n in self._entry}
            self._table, self._stale = table, False
            self._peers_seen = None
        if slots.peer_slots is not self._peers_seen:  # a new peer list: every entry again (module docstring)
            self._peers_seen = slots.peer_slots
            for n, e in self._entry.items():
                c = self._counts[n]
                table.write(e, self.active.get(n, 0), c[0], c[1], c[2])
        return self._entry

    def sync(self, t: Tenant, lim: TenantLimits | None) -> tuple[int, int]:
        """(the live peers' open requests of ``t``, the scale of this admission: 1, or N without an entry); debits
        ``lim`` by what the peers consumed since the last call (module docstring). Only when :meth:`grouped`."""
        slots = self.state.slots
        assert slots is not None
        e = self._entries(slots).get(t.name)
        if e is None:
            n = 1 + len(slots.peer_slots)
            if t.name not in self._warned:
                self._warned.add(t.name)
                log.warning("tenant %s has no entry in the segment's tenant table (more limited tenants than it "
                            "holds): its limits are divided among the %d router processes instead", t.name, n)
            return 0, n
        inflight, d_req, d_tok = slots.tenants.peers(self.tags[t.name], slots.peer_slots)
        if lim is not None and (d_req or d_tok):
            lim.debit(d_req, d_tok)
        return inflight, 1

    def publish(self, t: Tenant, requests: int = 0, tokens: int = 0) -> None:
        """This process's open requests of ``t`` now (the gate's count), ``requests`` more admitted, ``tokens`` more
        taken (negative: given back), into its entry (nothing without an entry). Only when :meth:`grouped`."""
        slots = self.state.slots
        assert slots is not None
        e = self._entries(slots).get(t.name)
        if e is None:
            return
        c = self._counts[t.name]
        c[0] += requests
        if tokens > 0:
            c[1] += tokens
        else:
            c[2] -= tokens
        slots.tenants.write(e, self.active.get(t.name, 0), c[0], c[1], c[2])


__all__ = ["GroupQuota", "group_limits_note", "limited"]
