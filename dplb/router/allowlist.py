"""A tenant's model allow-list applied to one request: which model the request would run, and whether the tenant may
use it (docs/DESIGN.md §15; called by the tenant gate, :meth:`dplb.router.tenancy.Gate.enter`).

Contract (no I/O: the request's peeked fields, its body and the workers' model side table)
- :func:`model_refusal` answers for a tenant with ``models``: the model a request runs is its JSON ``model``, or
  its multipart form's ``model`` field read in the whole body (:func:`dplb.router.intake.form_models`; a form the
  router might read otherwise than vLLM's form parser does is refused). A request naming no model, ``null`` or
  ``""`` runs on the worker's *default model* (vLLM's first served name, :meth:`ServedModels.defaults`): that is
  checked, and the request is kept off the workers whose default the tenant may not use (its routing request's
  ``cannot_serve``). Resolving rather than refusing every model-less request keeps clients that omit ``model``
  working for a tenant allowed the base model, and gives exactly what vLLM would have served.
- Refusals: 403 ``model_not_allowed`` naming the tenant's models (for a model-less request, saying the workers'
  default model is not one it may use, without naming that default: no oracle of the served names); a form with
  two ``model`` fields, or one the router cannot read for sure (:func:`ambiguous`), is that 403 whatever it names,
  never the 404 of an unserved model; 503 ``no_routable_worker`` while no worker's model list is known yet. The
  routes that run no model (``/v1/responses/{id}`` and ``…/cancel``: a stored response) are not checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dplb.errors import RouterErrorKind
from dplb.router.intake import form_models
from dplb.tenants import Tenant

if TYPE_CHECKING:
    from dplb.router.exchange import Exchange
    from dplb.router.models import ServedModels


def ambiguous(found: list[str | None]) -> bool:
    """True when a form's ``model`` fields (:func:`dplb.router.intake.form_models`) may not be read as vLLM reads
    them: more than one, or one the router could not read for sure. For a tenant with an allow-list such a form is
    403 ``model_not_allowed`` whatever its fields name, before the router looks at whether a model is served (the
    proxy's 404 ``model_not_found`` waits for this check: :meth:`dplb.router.proxy.Proxy.take_body`)."""
    return len(found) > 1 or None in found


def model_refusal(ex: Exchange, t: Tenant, models: ServedModels) -> tuple[RouterErrorKind, str] | None:
    """Why tenant ``t`` (with an allow-list) may not send ``ex`` (the error kind and message), or None: it may, and
    a request naming no model is then kept off the workers whose default model ``t`` may not use (module
    docstring). ``models``: the workers' served and default models."""
    route = ex.route
    if route is None or route.body == "none":  # /v1/responses/{id}, …/cancel: a stored response, no model runs
        return None
    allowed = t.models or frozenset()
    names = ", ".join(sorted(allowed))
    model = ex.peek.model
    if route.body == "multipart":
        found = form_models(ex.body)
        if ambiguous(found):
            return (RouterErrorKind.MODEL_NOT_ALLOWED, f"tenant {t.name} may use only some models, so its form must "
                    "carry the model once, as one field written name=\"model\" (a value of 1-256 bytes on one "
                    f"line), or none; allowed: {names}")
        model = found[0] if found else None
    if model is not None and model != "":
        if isinstance(model, str) and model in allowed:
            return None
        return RouterErrorKind.MODEL_NOT_ALLOWED, f"tenant {t.name} may not use the model `{model}`; allowed: {names}"
    defaults = models.defaults()
    ok = frozenset(k for k, d in defaults.items() if d in allowed)
    if not ok:
        if not defaults:
            return (RouterErrorKind.NONE_ROUTABLE, "the request names no model and no worker's default model is "
                    f"known yet; retry shortly, or name one of tenant {t.name}'s models: {names}")
        return (RouterErrorKind.MODEL_NOT_ALLOWED, "the request names no model, so a worker would serve it with "
                f"its default model, which is not one tenant {t.name} may use; name one of its models in "
                f"`model`: {names}")
    req = ex.request
    req.cannot_serve = req.cannot_serve | (frozenset(range(models.num_workers)) - ok)
    return None


__all__ = ["ambiguous", "model_refusal"]
