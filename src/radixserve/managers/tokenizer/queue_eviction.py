"""Which waiting requests a more important newcomer evicts when ``--max-queued-requests`` is
reached (``--enable-priority-scheduling``; docs/priority.md), as SGLang's scheduler does when
its waiting queue is full: the least important waiting request goes (among equals the newest),
and only for a newcomer strictly more important than it; the evicted request ends with a 503,
"The request is aborted by a higher priority request.".

The limit is counted at the HTTP edge (generations in flight, ``server/admission.py``), so the
choice is made here, on the ``TokenizerManager``'s states: a call (the states that share one
``notify`` event: every prompt and sample of one request) is *waiting* while none of its
requests has sent back anything yet, that is, none has been prefilled. A call is evicted whole;
calls are taken, least important first, until they free as many generations as the newcomer
lacks, or none is evicted.
"""

from __future__ import annotations

from typing import Any

from radixserve.managers.tokenizer.request_state import ReqState

EVICTED_MESSAGE = "The request is aborted by a higher priority request."
EVICTED_STATUS = 503
_LEAST = {False: -(2**63), True: 2**63 - 1}  # the least important value, by convention


def importance(priority: int | None, args: Any) -> int:
    """Larger is more important, whatever the convention (``args``: the server's flags);
    None is the priority a request that names none gets (``--default-priority-value``)."""
    low_first = bool(args.schedule_low_priority_values_first)
    if priority is None:
        priority = args.default_priority_value
        if priority is None:
            priority = _LEAST[low_first]
    return -priority if low_first else priority


def pick_evictions(
    states: list[ReqState], newcomer: int, needed: int, args: Any
) -> list[ReqState]:
    """The states to evict so that ``needed`` generations of importance ``newcomer`` fit; []
    when the waiting calls less important than it cannot free that many."""
    calls: dict[int, list[ReqState]] = {}
    for state in states:
        calls.setdefault(id(state.notify), []).append(state)
    candidates = []
    for call in calls.values():
        if any(s.finished or s.evicted or s.prompt_tokens or s.embedding is not None
               for s in call):
            continue  # ended, already evicted, or started: not waiting
        rank = importance(call[0].priority, args)
        if rank < newcomer:
            candidates.append((rank, -call[0].metrics.arrival_time, call))
    candidates.sort(key=lambda c: (c[0], c[1]))  # least important, then newest, first
    victims: list[ReqState] = []
    for _, _, call in candidates:
        if len(victims) >= needed:
            break
        victims.extend(call)
    return victims if len(victims) >= needed else []
