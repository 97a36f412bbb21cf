"""Speculative decoding on the scheduler's side (docs/speculative.md, docs/architecture.md §4).

With ``--speculative-algorithm`` the scheduler runs ``SpeculativeLoop``, a peer of the other
loops: a step is planned as usual (``get_next_batch_to_run``; a decode step has already given
each request one KV slot for its newest token), and when it is a decode step that may speculate
(``SpeculativeDecoder.eligible``) it is replaced by a *verify step*:

1. the proposer (``speculative/ngram.py``, or the draft model of ``draft_proposer.py``) drafts
   up to ``--speculative-num-draft-tokens`` tokens per request (STANDALONE:
   ``--speculative-num-steps``), never more than the request may still generate;
2. KV slots for the drafts are allocated behind the decode slot (evicting from the prefix cache
   first; when even that is short, the step decodes without drafts);
3. the target runs one EXTEND over ``[newest token, drafts...]`` of every request (per-request
   lengths; the logits of every position come back through the rows ``ForwardBatch`` keeps
   for input logprobs) and takes its argmax at each position;
4. ``SpeculativeOutputProcessor`` appends the accepted tokens one at a time
   (``speculative/verify.py``), running ``check_finished`` after each, so that a stop token,
   a stop string or ``max_new_tokens`` reached inside a draft ends the request right there; the
   KV of tokens not kept is freed (``free_rejected_kv``) and the request's ``kv_len`` is again
   ``len(all_ids) - 1``, as after a plain decode step, so retraction, the radix cache and
   sessions see nothing unusual.

A batch speculates only when it is at most ``--speculative-max-batch-size`` requests (above it a
verify step costs more than it gains) and no request in it asks for logprobs, a logit bias,
penalties, a pending ``min_new_tokens``, a grammar or (sampled) a ``sampling_seed``: then a
greedy request keeps the drafts equal to the target's argmax, a sampled one is verified by
rejection sampling (``speculative/verify.py``), and each gets exactly what the sampler would
give it. Any other batch, and a batch for which no request found a draft, runs the plain
decode step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.finish_reason import FinishAbort
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.managers.scheduler.draft_proposer import DraftModelProposer
from radixserve.managers.scheduler.output_processor import OutputProcessor
from radixserve.managers.scheduler.schedule_batch import (
    Req,
    ScheduleBatch,
    pages_to_alloc,
    release_kv,
)
from radixserve.managers.scheduler.scheduler_loop import LoopScheduler, NormalLoop
from radixserve.managers.scheduler.tp_worker import TpModelWorker
from radixserve.speculative import (
    NgramProposer,
    free_rejected_kv,
    greedy_accept,
    rejection_accept,
    sampling_probs,
)

logger = logging.getLogger(__name__)


@dataclass
class SpeculativeStats:
    """Counters of verify steps, named after what SGLang reports (docs/speculative.md)."""

    num_verify_steps: int = 0  # verify forwards run
    num_verify_reqs: int = 0  # request-steps in them
    num_draft_tokens: int = 0  # drafts proposed
    num_accepted_drafts: int = 0  # drafts kept
    num_output_tokens: int = 0  # tokens gained (kept drafts + one per request-step)

    def summary(self) -> dict[str, Any]:
        reqs = max(self.num_verify_reqs, 1)
        return {
            "spec_num_verify_steps": self.num_verify_steps,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_drafts": self.num_accepted_drafts,
            # tokens per request per verify forward (1.0: nothing accepted)
            "avg_spec_accept_length": self.num_output_tokens / reqs,
            "spec_accept_rate": self.num_accepted_drafts / max(self.num_draft_tokens, 1),
        }


@dataclass
class VerifyResult:
    """What one verify step computed for each request of its batch."""

    drafts: list[list[int]]
    gained: list[list[int]]  # the tokens each request keeps (greedy or rejection sampling)
    # Per request asking for logprobs: the raw-logit logprob of each kept token (else None).
    logprobs: list[list[float] | None]
    allocated_end: list[int]  # positions of the request's row with a KV slot after the step
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)


def may_speculate(req: Req) -> bool:
    """Whether the verify step gives ``req`` exactly the sampler's distribution: greedy (the
    argmax), or sampled from temperature/top-k/top-p/min-p alone without a per-request seed
    (rejection sampling; a seeded request's reproducible stream is the sampler's own). Logprobs
    of the kept tokens are given; top logprobs and ``token_ids_logprob`` are not (yet)."""
    params = req.sampling_params
    return (
        (params.is_greedy or params.sampling_seed is None)
        and not req.top_logprobs_num
        and not req.token_ids_logprob
        and req.grammar is None
        and not params.logit_bias
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and params.repetition_penalty == 1.0
        and len(req.output_ids) >= params.min_new_tokens
    )


@dataclass(eq=False)
class SpeculativeDecoder:
    """Drafts a prepared decode batch and runs the target's verify forward over it."""

    tp_worker: TpModelWorker
    proposer: NgramProposer | None  # NGRAM
    num_draft_tokens: int  # drafts per request and step (NGRAM's flag; STANDALONE's num_steps)
    max_batch_size: int  # --speculative-max-batch-size: larger batches decode plainly
    context_len: int
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    draft_model: DraftModelProposer | None = None  # STANDALONE

    def sweep(self, running: list[Req]) -> None:
        """Free the draft model's state of requests no longer running (after every step)."""
        if self.draft_model is not None:
            self.draft_model.sweep(running)

    def eligible(self, batch: ScheduleBatch) -> bool:
        return (
            batch.forward_mode.is_decode
            and 0 < len(batch) <= self.max_batch_size
            and all(may_speculate(r) for r in batch.reqs)
        )

    def _drafts(
        self, batch: ScheduleBatch
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Each request's drafts, and (a draft model's sampled request) their distributions."""
        # The request gains at most len(drafts) + 1 tokens; its row ends at context_len.
        rooms = [
            min(self.num_draft_tokens, req.remaining_new_tokens() - 1,
                self.context_len - req.kv_len)
            for req in batch.reqs
        ]
        if self.draft_model is not None:
            proposal = self.draft_model.propose(batch, rooms)
            return proposal.drafts, proposal.draft_probs
        assert self.proposer is not None
        drafts = [
            self.proposer.propose(req.all_ids, room) if room > 0 else []
            for req, room in zip(batch.reqs, rooms, strict=True)
        ]
        return drafts, [None] * len(drafts)

    def verify(self, batch: ScheduleBatch) -> VerifyResult | None:
        """The verify step of a decode batch prepared by ``prepare_for_decode``; None when no
        request has a draft or their KV does not fit (the caller runs the plain decode)."""
        drafts, draft_probs = self._drafts(batch)
        if not any(drafts):
            return None
        resources = batch.resources
        allocator, cache = resources.allocator, resources.tree_cache
        # After prepare_for_decode: kv_len == len(all_ids), the newest token at kv_len - 1.
        starts = [r.kv_len for r in batch.reqs]
        ends = [s + len(d) for s, d in zip(starts, drafts, strict=True)]
        need = sum(pages_to_alloc(s, e, allocator.page_size) for s, e in zip(starts, ends,
                                                                              strict=True))
        if need > allocator.available_size() + cache.reclaimable_size():
            if self.draft_model is not None:  # nothing verified: the drafts' KV goes
                self.draft_model.after_verify(batch, drafts, [[] for _ in drafts])
            return None
        if allocator.available_size() < need:
            cache.evict(need - allocator.available_size())
        decode_locs = batch.out_cache_loc.tolist()
        draft_locs = allocator.alloc_extend(starts, ends, decode_locs)
        assert draft_locs is not None, "capacity was checked"
        rows = [r.req_pool_idx for r in batch.reqs]
        table = resources.req_to_token_pool.req_to_token
        counts = [len(d) for d in drafts]
        token_rows = torch.tensor(rows, dtype=torch.int64).repeat_interleave(torch.tensor(counts))
        draft_pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        table[token_rows.to(table.device), draft_pos.to(table.device)] = draft_locs.to(
            table.device
        )

        input_ids: list[int] = []
        positions: list[int] = []
        out_locs: list[int] = []
        offset = 0
        draft_locs_list = draft_locs.tolist()
        for req, start, draft, loc in zip(batch.reqs, starts, drafts, decode_locs, strict=True):
            input_ids += [req.output_ids[-1], *draft]
            positions += range(start - 1, start + len(draft))
            out_locs += [loc, *draft_locs_list[offset : offset + len(draft)]]
            offset += len(draft)
        device = resources.device

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device)

        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=dev(input_ids),
            positions=dev(positions),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=dev(ends),
            out_cache_loc=dev(out_locs),
            seq_lens_cpu=list(ends),
            extend_prefix_lens_cpu=[s - 1 for s in starts],
            extend_seq_lens_cpu=[n + 1 for n in counts],
            # Every position's logits: the last of each request, then the others in order.
            input_logprob_starts=[0] * len(counts),
            input_logprob_counts=counts,
            lora_slots=batch.lora_slots(),  # each request's drafts judged under its adapter
        )
        gained, logprobs = self._accept(batch, forward_batch, drafts, draft_probs)
        if self.draft_model is not None:
            self.draft_model.after_verify(batch, drafts, gained)
        self.stats.num_verify_steps += 1
        return VerifyResult(drafts, gained, logprobs, ends, self.stats)

    def _accept(
        self, batch: ScheduleBatch, forward_batch: ForwardBatch, drafts: list[list[int]],
        draft_probs: list[torch.Tensor | None],
    ) -> tuple[list[list[int]], list[list[float] | None]]:
        """The target's verdict on each request's drafts: the tokens it keeps, and their
        logprobs (from the raw logits, as the sampler gives them) when it asks for them."""
        runner = self.tp_worker.model_runner
        with torch.inference_mode():
            logits = runner.forward(forward_batch)
            assert isinstance(logits, torch.Tensor), "speculation runs without pipeline stages"
            tokens = runner._sampler.greedy_argmax(logits).tolist()
        bs = len(drafts)
        gained: list[list[int]] = []
        logprobs: list[list[float] | None] = []
        offset = bs
        for i, (req, draft) in enumerate(zip(batch.reqs, drafts, strict=True)):
            n = len(draft)
            params = req.sampling_params
            rows = [*range(offset, offset + n), i]  # row j predicts the token after draft j
            if params.is_greedy:
                kept = greedy_accept(draft, [tokens[r] for r in rows])
            else:
                probs = sampling_probs(
                    logits[rows], params.temperature, params.top_k, params.top_p, params.min_p
                )
                kept = rejection_accept(draft, probs, draft_probs=draft_probs[i])
            gained.append(kept)
            if req.return_logprob:
                chosen = torch.log_softmax(logits[rows[: len(kept)]].float(), dim=-1)
                index = torch.tensor(kept, device=chosen.device)
                logprobs.append(chosen[torch.arange(len(kept)), index].tolist())
            else:
                logprobs.append(None)
            offset += n
        return gained, logprobs


class SpeculativeOutputProcessor(OutputProcessor):
    """The output processor of a speculative scheduler: a ``VerifyResult`` gives each request
    the tokens it kept, checked one by one; anything else is a plain step."""

    def process_batch_result(self, batch: ScheduleBatch, result: Any) -> None:
        if not isinstance(result, VerifyResult):
            super().process_batch_result(batch, result)
            return
        resources = batch.resources
        table = resources.req_to_token_pool.req_to_token
        stats = result.stats
        reports: list[Req] = []
        for i, req in enumerate(batch.reqs):
            start = req.kv_len  # len(all_ids): the newest token's KV was written this step
            gained = result.gained[i]
            values = result.logprobs[i]
            slot = [0.0] * len(batch.reqs)  # _apply_token reads request i's logprob at [i]
            kept = 0
            try:
                for j, token in enumerate(gained):
                    if values is not None:
                        slot[i] = values[j]
                    self._apply_token(req, i, token, slot, None)
                    kept += 1
                    if req.finished():
                        break
            except Exception as e:  # a bug that concerns this request alone fails it alone
                logger.exception("failed to process the output of request %r", req.rid)
                message = f"internal error while processing the output: {type(e).__name__}: {e}"
                req.finished_reason = FinishAbort(message=message, status_code=500)
            stats.num_verify_reqs += 1
            stats.num_draft_tokens += len(result.drafts[i])
            stats.num_accepted_drafts += max(kept - 1, 0)
            stats.num_output_tokens += kept
            # KV exists for the newest token and the kept drafts but the last kept token.
            req.kv_len = start + max(kept - 1, 0)
            free_rejected_kv(
                resources.allocator, table, req.req_pool_idx, req.kv_len, result.allocated_end[i]
            )
            if req.finished():
                release_kv(req, self.tree_cache)
            if req.finished() or self._stream_due(req):
                reports.append(req)
        self.send_outputs(reports)


class SpeculativeLoop(NormalLoop):
    """The normal loop, whose eligible decode steps are verify steps."""

    def __init__(
        self, scheduler: LoopScheduler, watchdog_timeout: float, decoder: SpeculativeDecoder
    ) -> None:
        super().__init__(scheduler, watchdog_timeout)
        self.decoder = decoder

    def summary(self) -> dict[str, Any]:
        summary = self.decoder.stats.summary()
        draft = self.decoder.draft_model
        if draft is not None:  # STANDALONE: the draft pool's use (0 when idle: nothing leaked)
            summary.update(draft.usage())
        return summary

    def run_step(self) -> bool:
        """A step, then the draft model's state of requests that stopped running is freed."""
        busy = super().run_step()
        self.decoder.sweep(self.scheduler.running_batch.reqs)
        return busy

    def forward(self, batch: ScheduleBatch) -> Any:
        """A verify step where the batch is eligible and drafts were proposed, else the plain
        model step."""
        if self.decoder.eligible(batch):
            self.scheduler.note_launch()
            result = self.decoder.verify(batch)
            if result is not None:
                self.scheduler.model_step_done()
                return result
        return self.scheduler.run_batch(batch)
