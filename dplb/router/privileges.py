"""What a key may do on the router's own routes when tenants share it: LoRA administration, how much of a routing
decision it may read, and the routes that only an operator's key may read (docs/DESIGN.md §15).

Contract (no I/O: :mod:`dplb.router.local` calls these with the caller's tenant, None when the gate is off — no
key is configured — and then nothing here restricts anything)
- Operators: :attr:`dplb.tenants.Tenant.operator` — ``--api-key``'s key (tenant ``default``; also every request
  when no key is configured) and the keys of a tenant with ``admin = true`` in the tenants file.
- :func:`lora_refusal`: ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (``--allow-runtime-lora``,
  fanned out to every worker) is an operator's: any other tenant's key gets 403 ``admin_only``, whatever its
  ``models``; an operator tenant with a ``models`` allow-list may touch only the adapters it names (403
  ``model_not_allowed``: a team's own adapter-publishing key, scoped to its adapters).
- :func:`decision_view`: a tenant's key reads only its own decisions (:mod:`dplb.router.local` filters them) and of
  each only :data:`TENANT_DECISION_FIELDS`: when, which request, which worker served it, why (the reason) and the
  policy. Every candidate's live load (``num_running``, ``num_waiting``, ``queue``, ``correction``, KV and GPU
  memory use, latencies), its health, the scorers' inputs, terms and scores, the latency baseline and the shared
  prefix index's verdict are dropped: they are the sum of every tenant's traffic (a tenant could watch another's
  load rise and fall, or test whether another tenant sent a prompt, from its own decisions). An allow-list, not a
  deny-list: a field a scorer adds later is not shown to tenants until it is added here. Operators read every
  tenant's decisions, whole.
- :func:`operator_refusal`: ``/metrics`` and ``/metrics/host`` name every tenant's traffic and every worker's load;
  where they need a key (taken out of ``--api-key-exempt``), only an operator's key reads them (403
  ``admin_only`` for the others). On an exempt path nobody is asked for a key and nothing is refused.

Why LoRA administration is an operator's (how the systems DPLB sits among gate it): an adapter is a server-wide
object — loaded on every worker, listed in every tenant's ``/v1/models``, holding one of the engine's
``--max-loras`` slots and GPU memory, read from a server-side ``lora_path`` the caller chooses — so unloading or
replacing one breaks every tenant that uses it, and a tenant's ``models`` list says what it may *use*, not what it
owns (two tenants may list the same adapter). vLLM serves the API only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
and warns that enabling it in production "is risky as users may participate in model adapter management"
(docs.vllm.ai, LoRA Adapters, "Dynamically serving LoRA Adapters"), behind its single ``--api-key``; the vLLM
production-stack does not expose it to clients at all: adapters are ``LoraAdapter`` custom resources
(``production-stack.vllm.ai/v1alpha1``) reconciled by its controller, so Kubernetes RBAC decides who administers
them; LiteLLM's proxy keeps model management (``/model/new``, ``/model/delete``) to its master key and
``proxy_admin`` users, and lets an operator add any route to ``admin_only_routes`` (docs.litellm.ai, "Control
Public & Private Routes", "Role-based Access Controls").
"""

from __future__ import annotations

from typing import Any

from dplb.errors import RouterErrorKind
from dplb.router.fanout import lora_name
from dplb.tenants import Tenant

#: The fields of a ``/debug/decisions`` entry (``Decision.to_dict`` plus time, request id and tenant) a tenant's key
#: reads of its own decisions (module docstring); a group adds ``process`` after.
TENANT_DECISION_FIELDS = ("time", "request_id", "tenant", "policy", "worker", "reason")


def lora_refusal(tenant: Tenant | None, body: bytes) -> tuple[RouterErrorKind, str] | None:
    """Why the caller (``tenant``; None: no key configured) may not send the LoRA load/unload ``body`` (the error
    kind and message), or None: it may (module docstring)."""
    if tenant is None:
        return None
    if not tenant.operator:
        return (RouterErrorKind.ADMIN_ONLY, f"tenant {tenant.name} may not load or unload LoRA adapters: an adapter "
                "is shared by every tenant of the server; use the router's --api-key or the key of a tenant with "
                "admin = true in the tenants file")
    name = lora_name(body)
    if not tenant.may_use(name):
        assert tenant.models is not None
        return (RouterErrorKind.MODEL_NOT_ALLOWED, f"tenant {tenant.name} may load or unload only the adapters its "
                f"models list names ({', '.join(sorted(tenant.models))}), not `{name}`")
    return None


def decision_view(entry: dict[str, Any]) -> dict[str, Any]:
    """A tenant's view of one of its ``/debug/decisions`` entries: :data:`TENANT_DECISION_FIELDS` only."""
    return {k: entry[k] for k in TENANT_DECISION_FIELDS if k in entry}


def operator_refusal(tenant: Tenant | None, path: str) -> tuple[RouterErrorKind, str] | None:
    """Why the caller (``tenant``; None: no key configured, or no key needed on this path) may not read the
    operator's route ``path`` (module docstring), or None."""
    if tenant is None or tenant.operator:
        return None
    return (RouterErrorKind.ADMIN_ONLY, f"{path} shows every tenant's traffic; tenant {tenant.name}'s key may not "
            "read it (the router's --api-key or a tenant with admin = true may)")


__all__ = ["TENANT_DECISION_FIELDS", "decision_view", "lora_refusal", "operator_refusal"]
