"""Who sent the request being served: the key the HTTP edge authenticated, as a context value.

``RequestGuard`` (server/request_guard.py) sets ``current_caller`` for the task that serves a
request; what the request creates is then owned by that caller: the ``ReqState`` of each of its
generations (a plain key may abort only those, ``TokenizerManager.abort_request``), a stored
``/v1/responses`` object (read, continued and deleted only with the key that stored it), and the
Batch API's files and batches (seen, read, cancelled and deleted only with the key that created
them, or the admin key: ``may_manage``).

``None`` means unscoped: no key is configured (every caller is the same) or the caller is not
HTTP (the ``Engine``). The server has one ``--api-key`` and one ``--admin-api-key``, so there are
at most three callers (the third: no key, where a route needs none); the ``user`` field of a
request identifies nobody (it is not authenticated).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar

ADMIN = "admin"  # authenticated with --admin-api-key
API_KEY = "api-key"  # authenticated with --api-key
ANONYMOUS = "anonymous"  # no key, on a route no key guards (keys are configured)

current_caller: ContextVar[str | None] = ContextVar("radixserve_caller", default=None)


def may_act_for(caller: str | None, owner: str | None) -> bool:
    """Whether ``caller`` may act on something ``owner`` created: the same caller, or an
    unscoped one (``None``: no keys, or the Engine)."""
    return caller is None or caller == owner


def may_manage(caller: str | None, owner: str | None) -> bool:
    """``may_act_for``, and the admin key too: who may see and manage a Batch API file or batch
    (OpenAI's organisation admin sees every batch; anyone else gets a 404 for ids not theirs)."""
    return caller == ADMIN or may_act_for(caller, owner)


def abort_targets(rid: str, owners: Mapping[str, str | None], caller: str | None) -> list[str]:
    """The requests an abort of ``rid`` by ``caller`` reaches, given the in-flight requests'
    ``owners`` (rid -> owner): ``rid`` itself when in flight, else every generation a call
    named ``rid`` started (SGLang names them ``rid_0``, ``rid_1``, ...: a batch's prompts, the
    samples of n > 1), as SGLang's abort reaches them; of those, only the caller's own. A rid
    not in flight is passed on (aborting it does nothing)."""
    family = [rid] if rid in owners else [r for r in owners if r.startswith(f"{rid}_")]
    return [r for r in family or [rid] if r not in owners or may_act_for(caller, owners[r])]
