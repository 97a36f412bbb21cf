"""Retraction: what decode does when the KV pool cannot hold one more token per request.

Admission reserves only ``new_token_ratio`` of what running requests may still decode, so a
decode step can run short.  Then requests are retracted until the rest fits: their KV goes to
the prefix cache (a radix tree keeps it as evictable, so the retracted request usually gets it
back on re-admission), they return to the front of the waiting queue with their output kept, and
their next prefill covers ``origin_input_ids + output_ids``.  The ratio is raised so admission
reserves more from then on; it decays back while decoding proceeds without trouble.

A request is only failed for memory when it is the last one running and still cannot grow: the
pool cannot hold it alone. With pipeline parallelism the other micro-batches' requests hold KV
too: a micro-batch's last request then waits in the queue for their memory instead (how requests
fall into micro-batches depends on when they arrive, so this happens on a loaded machine).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.managers.scheduler.schedule_batch import Req, ScheduleBatch, release_kv
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache

# A retracted batch is assumed to decode at least this many more steps when re-estimating the
# ratio, so the estimate does not collapse to what was decoded so far.
_RETRACT_DECODE_STEPS = 20


@dataclass
class NewTokenRatio:
    """Fraction of a running request's remaining ``max_new_tokens`` admission reserves."""

    init: float
    minimum: float
    decay: float
    value: float

    @classmethod
    def from_conservativeness(cls, conservativeness: float) -> NewTokenRatio:
        init = min(0.7 * conservativeness, 1.0)
        minimum = min(0.14 * conservativeness, init)
        # Back from init to minimum over ~600 untroubled decode steps.
        return cls(init=init, minimum=minimum, decay=(init - minimum) / 600, value=init)

    def step(self) -> None:
        """One decode step ran without retraction."""
        self.value = max(self.minimum, self.value - self.decay)

    def raise_to(self, estimate: float) -> None:
        self.value = min(1.0, max(self.value, estimate))


@dataclass
class RetractResult:
    retracted: list[Req] = field(default_factory=list)  # back to the waiting queue's front
    cannot_fit: list[Req] = field(default_factory=list)  # the pool cannot hold these alone


def decode_fits(batch: ScheduleBatch) -> bool:
    """Whether the next decode step of ``batch`` can allocate (evicting from the cache)."""
    resources = batch.resources
    capacity = resources.allocator.available_size() + resources.tree_cache.reclaimable_size()
    return batch.decode_tokens_needed() <= capacity


def retract_for_decode(
    batch: ScheduleBatch, ratio: NewTokenRatio, others_hold_kv: bool = False
) -> RetractResult:
    """Retract requests from ``batch`` until its next decode step can allocate.

    Victims are the requests that would hold memory longest: most remaining tokens first, and
    among equals the most recent (fewest outputs). Their KV goes to the prefix cache and their
    rows are freed; ``batch.reqs`` keeps the rest. The last one cannot fit alone, unless
    ``others_hold_kv`` (other micro-batches run requests): then it is retracted too.
    """
    resources = batch.resources
    result = RetractResult()
    if decode_fits(batch):
        return result
    batch.reqs.sort(key=lambda r: (r.remaining_new_tokens(), -len(r.output_ids)))
    while not decode_fits(batch):
        victim = batch.reqs.pop()
        release_kv(victim, resources.tree_cache)
        if batch.reqs or others_hold_kv:
            victim.reset_after_retract()
            result.retracted.append(victim)
        else:
            result.cannot_fit.append(victim)
    if result.retracted and batch.reqs:
        decoded = sum(len(r.output_ids) for r in batch.reqs)
        max_new = sum(r.sampling_params.max_new_tokens for r in batch.reqs)
        ratio.raise_to((decoded + _RETRACT_DECODE_STEPS * len(batch.reqs)) / max(max_new, 1))
    return result


def retract_all(reqs: list[Req], tree_cache: BasePrefixCache) -> list[Req]:
    """Retract every one of ``reqs`` (a pause in retract mode): KV to the prefix cache, rows
    freed, outputs kept; returns them for the front of the waiting queue."""
    for req in reqs:
        release_kv(req, tree_cache)
        req.reset_after_retract()
    return reqs
