"""Stored responses bound to the tenant that created them (docs/DESIGN.md §15): with a tenants file, the router
remembers each ``/v1/responses`` id with its worker *and its tenant*, and only that tenant or an operator may name
it again.

Contract (with ``--tenants`` only: without a tenants file the proxy keeps the plain
:class:`dplb.router.routes.ResponseIds`, and nothing here runs)
- :class:`OwnedResponseIds`: :meth:`~OwnedResponseIds.remember` keeps the creating request's tenant with the
  worker (same LRU: the ``response_ids`` most recent ids).
- :meth:`OwnedResponseIds.refusal` (the tenant gate, :meth:`dplb.router.tenancy.Gate.enter`, before the routing
  decision, so no worker is asked):
  - ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and ``POST /v1/responses`` with
    ``previous_response_id``: 404 ``response_not_found`` in vLLM's own words (``Response with id '…' not found.``)
    unless the id was created by the caller's tenant through this router process. An operator
    (:attr:`dplb.tenants.Tenant.operator`) may name any id (an unknown one is then routed by score, as without
    tenants).
  - An id the router cannot tell the creator of — never seen, forgotten past the LRU, created before the router
    restarted or through another process of a group — is refused the same way: fail closed. Letting it through
    would hand any tenant a response whose binding was forgotten, and a tenant can make the router forget by
    creating responses.
  - ``POST /v1/responses`` whose ``request_id`` is another tenant's id (any caller's, operators' too): 409
    ``response_id_in_use``. vLLM stores a response under the ``request_id`` its client chose
    (``ResponsesRequest.request_id`` becomes ``response.id``), replacing the one stored there: another tenant's
    conversation, which that tenant's next ``previous_response_id`` would then continue.
"""

from __future__ import annotations

import collections
from typing import Any

from dplb.errors import RouterErrorKind
from dplb.router.routes import MAX_ID_CHARS, RESPONSES_PREFIX, ResponseIds
from dplb.tenants import Tenant

_RESPONSES = RESPONSES_PREFIX.rstrip("/")
_CANCEL = "/cancel"


class OwnedResponseIds(ResponseIds):
    """:class:`ResponseIds` that also keep each id's tenant (module docstring)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # id → tenant name, in the same LRU order as the worker map (both change only in remember)
        self._owner: collections.OrderedDict[str, str | None] = collections.OrderedDict()

    def remember(self, response_id: str, worker: int, ex: Any = None) -> None:
        """``worker`` created ``response_id`` for ``ex``'s tenant (``ex``: the exchange of the creating request)."""
        if len(response_id) > MAX_ID_CHARS:  # not kept (ResponseIds): its follow-ups are refused, unattributed
            return
        super().remember(response_id, worker)
        tk = ex.tenant if ex is not None else None
        o = self._owner
        o[response_id] = tk.tenant.name if tk is not None else None
        o.move_to_end(response_id)
        if len(o) > self.capacity:
            o.popitem(last=False)

    def owner_of(self, response_id: str) -> str | None:
        """The tenant that created ``response_id``, or None when unknown."""
        return self._owner.get(response_id)

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
            if isinstance(taken, str) and self.owner_of(taken) not in (None, t.name):
                return (RouterErrorKind.RESPONSE_ID_IN_USE, f"request_id '{taken}' is the id of another tenant's "
                        "stored response; leave request_id out (vLLM then makes a unique one) or choose another")
            rid = ex.peek.previous_response_id
            if not isinstance(rid, str):  # none, or not a string (the worker's 400)
                return None
        else:
            return None
        if t.operator or self.owner_of(rid) == t.name:
            return None
        return RouterErrorKind.RESPONSE_NOT_FOUND, f"Response with id '{rid}' not found."


__all__ = ["OwnedResponseIds"]
