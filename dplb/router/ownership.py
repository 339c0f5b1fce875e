"""Stored responses bound to the tenant that created them (docs/DESIGN.md §15): with a tenants file, the router
remembers each ``/v1/responses`` id with its worker *and its tenant*, and only that tenant or an operator may name
it again.

Contract (with ``--tenants`` only: without a tenants file the proxy keeps the plain
:class:`dplb.router.routes.ResponseIds`, and nothing here runs)
- :class:`OwnedResponseIds`: :meth:`~OwnedResponseIds.remember` keeps the creating request's tenant with the
  worker (same LRU: the ``response_ids`` most recent ids), as a tag every router process derives alike from the
  tenant's name (:func:`dplb.tenants.tenant_tag`), so the ids another process of the group (or another router on
  the segment) relayed are known here with their tenant (:mod:`dplb.state.response_rings`).
- :meth:`OwnedResponseIds.refusal` (the tenant gate, :meth:`dplb.router.tenancy.Gate.enter`, before the routing
  decision, so no worker is asked):
  - ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and ``POST /v1/responses`` with
    ``previous_response_id``: 404 ``response_not_found`` in vLLM's own words (``Response with id '…' not found.``)
    unless the id was created by the caller's tenant (through any router process on the segment). An operator
    (:attr:`dplb.tenants.Tenant.operator`) may name any id (an unknown one is then routed by score, as without
    tenants).
  - An id the router cannot tell the creator of — never seen by any router process on the segment, forgotten
    past the LRU, lapped in a peer's ring before this process read it, relayed by a router whose slot was since
    taken over (a restarted single router empties its ring) — is refused the same way: fail closed. Letting it
    through would hand any tenant a response whose binding was forgotten, and a tenant can make the router forget
    by creating responses.
  - ``POST /v1/responses`` whose ``request_id`` is another tenant's id (any caller's, operators' too): 409
    ``response_id_in_use``. vLLM stores a response under the ``request_id`` its client chose
    (``ResponsesRequest.request_id`` becomes ``response.id``), replacing the one stored there: another tenant's
    conversation, which that tenant's next ``previous_response_id`` would then continue.
"""

from __future__ import annotations

from typing import Any

from dplb.errors import RouterErrorKind
from dplb.router.routes import RESPONSES_PREFIX, ResponseIds
from dplb.state.response_rings import NO_TENANT, TAG_MASK
from dplb.tenants import Tenant, tenant_tag

_RESPONSES = RESPONSES_PREFIX.rstrip("/")
_CANCEL = "/cancel"


class OwnedResponseIds(ResponseIds):
    """:class:`ResponseIds` that also keep each id's tenant, as its :func:`dplb.tenants.tenant_tag` (module
    docstring)."""

    def tag(self, ex: Any) -> int:
        """The tag of ``ex``'s tenant (``ex``: the exchange of the creating request; :data:`NO_TENANT` without
        one)."""
        tk = ex.tenant if ex is not None else None
        return tenant_tag(tk.tenant.name) if tk is not None else NO_TENANT

    def owner_of(self, response_id: str) -> int | None:
        """The tag of the tenant that created ``response_id`` (:data:`NO_TENANT`: created without one), or None
        when no router process on the segment knows it."""
        v = self.entry(response_id)
        return None if v is None else v & TAG_MASK

    def refusal(self, ex: Any, t: Tenant) -> tuple[RouterErrorKind, str] | None:
        """Why tenant ``t`` may not send ``ex`` (the error kind and message), or None (module docstring)."""
        route, scope = ex.route, ex.scope
        if route is None:
            return None
        if route.pinned:  # the id as the path carries it (ex.pin is None for one the LRU would not hold)
            rid: Any = scope["path"][len(RESPONSES_PREFIX):]
            if route.path.endswith(_CANCEL):
                rid = rid[: -len(_CANCEL)]
        elif route.path == _RESPONSES:
            taken = ex.peek.request_id
            if isinstance(taken, str) and self.owner_of(taken) not in (None, NO_TENANT, tenant_tag(t.name)):
                return (RouterErrorKind.RESPONSE_ID_IN_USE, f"request_id '{taken}' is the id of another tenant's "
                        "stored response; leave request_id out (vLLM then makes a unique one) or choose another")
            rid = ex.peek.previous_response_id
            if not isinstance(rid, str):  # none, or not a string (the worker's 400)
                return None
        else:
            return None
        if t.operator or self.owner_of(rid) == tenant_tag(t.name):
            return None
        return RouterErrorKind.RESPONSE_NOT_FOUND, f"Response with id '{rid}' not found."


__all__ = ["OwnedResponseIds"]
