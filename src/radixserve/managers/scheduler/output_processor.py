"""What happens to a batch after its model step: tokens in, finished requests out.

For every request of the batch:

- a prefill that asked for input logprobs collects those of the positions it computed (chunk by
  chunk; the first report after the prompt carries them all);
- a prefill chunk that is not the last only hands its KV to the cache (``cache_unfinished_req``)
  and samples nothing;
- a request that finished in the previous step samples nothing either: under the overlap
  schedule (``scheduler.py``) it was planned into this step before its end was known. The step
  wrote the KV of its last token (already counted in ``kv_len`` when it finished, and handed to
  the cache with the rest); the token it sampled is discarded;
- a prefill-only request (``max_new_tokens`` 0: SGLang's ``cache_prefix`` and ``select``)
  finishes with ``length`` and no token, its prompt cached;
- otherwise the sampled token (and its logprobs) is appended, its grammar (if any) advances,
  and ``check_finished`` runs; a finished request gives its KV to the cache
  (``cache_finished_req``); a request that just finished its prefill inserts its prompt into the
  cache so that others can share it while it decodes (``cache_unfinished_req``).

Then one ``BatchTokenIDOutput`` goes to the detokenizer: stream requests report their first token
at once, then every ``stream_interval`` tokens (the request's, else ``--stream-interval``; 1:
every step) and at finish; non-stream requests report once, at finish, with all their tokens.
Each report carries every token since the previous one.

A request whose output processing raises (a bug that concerns it alone) finishes with an abort
carrying ``status_code`` 500 and the error; the rest of the batch goes on.

An embedding model's batch (``process_embedding_result``) samples nothing: each request whose
input is complete finishes at once and its embedding goes to the tokenizer manager directly.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from radixserve import envs
from radixserve.constrained.limits import over_budget_message
from radixserve.finish_reason import FinishAbort, FinishLength, FinishReason
from radixserve.layers.sampler import InputLogprobs
from radixserve.managers.io_struct import (
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    LogprobsOutput,
    ReqEmbeddingOutput,
    ReqTokenOutput,
)
from radixserve.managers.scheduler.schedule_batch import Req, ScheduleBatch, release_kv
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache

logger = logging.getLogger(__name__)
_INJECTED_HANG_S = 3600.0


def _logprobs_output(req: Req, start: int) -> LogprobsOutput:
    """The logprobs of output tokens ``start:`` and, once, of the prompt."""
    out = LogprobsOutput(
        output=req.output_logprobs[start:],
        output_top=req.output_top_logprobs[start:] if req.top_logprobs_num else None,
        output_token_ids=req.output_token_ids_logprobs[start:] if req.token_ids_logprob else None,
    )
    if req.logprob_start_len >= 0 and not req.input_logprobs_sent and req.input_logprobs_done:
        req.input_logprobs_sent = True
        out.input_token_ids = req.origin_input_ids[req.logprob_start_len :]
        out.input = req.input_logprobs
        out.input_top = req.input_top_logprobs if req.top_logprobs_num else None
        out.input_token_ids_logprobs = (
            req.input_token_ids_logprobs if req.token_ids_logprob else None
        )
    return out


def cached_tokens_details(req: Req) -> dict[str, int] | None:
    """SGLang's per-tier split of ``cached_tokens`` (hierarchical cache only): ``device`` hits,
    and tokens loaded back from ``host`` memory and ``storage``."""
    tiers = req.cached_tokens_tiers
    if tiers is None:
        return None
    host = min(tiers["host"], req.cached_tokens)
    storage = min(tiers["storage"], req.cached_tokens - host)
    return {"device": req.cached_tokens - host - storage, "host": host, "storage": storage}


def make_output(req: Req) -> ReqTokenOutput:
    """The request's progress since its last output; advances its send offset."""
    start = req.send_offset
    req.send_offset = len(req.output_ids)
    params = req.sampling_params
    return ReqTokenOutput(
        rid=req.rid,
        new_token_ids=req.output_ids[start:],
        finished_reason=req.finished_reason,
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        cached_tokens_details=cached_tokens_details(req),
        stream=req.stream,
        stop=list(params.stop),
        stop_regex=list(params.stop_regex),
        no_stop_trim=params.no_stop_trim,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        logprobs=_logprobs_output(req, start) if req.return_logprob else None,
    )


class OutputProcessor:
    """Applies sampled tokens to requests and reports them to the detokenizer."""

    def __init__(
        self,
        tree_cache: BasePrefixCache,
        eos_token_ids: list[int],
        tokenizer: Any,
        send_to_detokenizer: Callable[[BatchTokenIDOutput], None],
        on_finish: Callable[[Req], None] | None = None,
        stream_interval: int = 1,
        send_to_tokenizer: Callable[[BatchEmbeddingOutput], None] | None = None,
        grammar_step_budget_s: float = math.inf,
    ) -> None:
        self.tree_cache = tree_cache
        self.stream_interval = stream_interval
        self.on_finish = on_finish
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = tokenizer
        self.send_to_detokenizer = send_to_detokenizer
        self.send_to_tokenizer = send_to_tokenizer
        self.inject_faults = envs.RADIXSERVE_TEST_INJECT_FAULTS.get()
        self.grammar_step_budget_s = grammar_step_budget_s  # constrained/limits.py

    def process_batch_result(self, batch: ScheduleBatch, result: Any) -> None:
        """``result`` is the runner's ``SampleOutput`` for ``batch``."""
        next_ids, logprobs = result.to_host()
        is_extend = batch.forward_mode.is_extend
        reports: list[Req] = []
        for i, req in enumerate(batch.reqs):
            if req.finished():
                continue
            if is_extend and result.input_logprobs is not None and req.wants_input_logprobs:
                _add_input_logprobs(req, result.input_logprobs[i])
            if req.is_chunked:
                self.tree_cache.cache_unfinished_req(req, req.fill_ids)
                continue
            try:
                self._apply_token(req, i, next_ids[i], logprobs, result)
            except Exception as e:  # a bug that concerns this request alone fails it alone
                logger.exception("failed to process the output of request %r", req.rid)
                message = f"internal error while processing the output: {type(e).__name__}: {e}"
                req.finished_reason = FinishAbort(message=message, status_code=500)
            if req.finished():
                if req.req_pool_idx is not None:
                    release_kv(req, self.tree_cache)
            elif is_extend:
                self.tree_cache.cache_unfinished_req(req, req.fill_ids)
            if req.finished() or self._stream_due(req):
                reports.append(req)
        self.send_outputs(reports)

    def _apply_token(
        self, req: Req, i: int, token: int, logprobs: list[float] | None, result: Any
    ) -> None:
        if self.inject_faults and req.rid.startswith("inject-fault-output-"):
            raise RuntimeError(f"injected fault while processing {req.rid}")
        if self.inject_faults and req.rid.startswith("inject-hang-"):
            time.sleep(_INJECTED_HANG_S)  # a hung step, for the watchdog's test
        if req.sampling_params.max_new_tokens == 0:
            req.finished_reason = FinishLength(length=0)
            return
        req.output_ids.append(token)
        if req.return_logprob:
            assert logprobs is not None, "the sampler returns logprobs when asked"
            req.output_logprobs.append(logprobs[i])
            if req.top_logprobs_num:
                req.output_top_logprobs.append(result.top_logprobs[i])
            if req.token_ids_logprob:
                req.output_token_ids_logprobs.append(result.token_ids_logprobs[i])
        if req.grammar is not None and not req.grammar.accept_token(token):
            # The sampler applies the grammar's mask, so the mask was empty: the grammar admits
            # no continuation of this output (it dead-ends; one that admits nothing at all is
            # refused when compiled). The request fails with an error, never a 200 with text
            # outside its grammar.
            logger.warning("request %r: token %d outside its grammar (a dead end after %d "
                           "tokens)", req.rid, token, len(req.output_ids))
            req.finished_reason = FinishAbort(
                message=f"the grammar admits no continuation of the output after "
                f"{len(req.output_ids)} tokens (it has a dead end)", status_code=400,
            )
            return
        if req.grammar is not None and req.grammar.slowest_s >= self.grammar_step_budget_s:
            # Its next steps would stall the whole batch longer still (constrained/limits)
            logger.warning("request %r: a grammar step took %.3f s; stopped", req.rid,
                           req.grammar.slowest_s)
            message = over_budget_message(req.grammar.slowest_s, self.grammar_step_budget_s)
            req.finished_reason = FinishAbort(message=message, status_code=400)
            return
        req.check_finished(self.eos_token_ids, self.tokenizer)

    def process_embedding_result(self, batch: ScheduleBatch, embeddings: torch.Tensor) -> None:
        """An embedding model's prefill: each request whose whole input is now computed is
        finished with its pooled embedding, which goes straight to the tokenizer manager."""
        assert self.send_to_tokenizer is not None, "embedding models send to the tokenizer"
        done: list[ReqEmbeddingOutput] = []
        for req, embedding in zip(batch.reqs, embeddings.tolist(), strict=True):
            if req.is_chunked:
                self.tree_cache.cache_unfinished_req(req, req.fill_ids)
                continue
            req.finished_reason = FinishLength(length=0)
            release_kv(req, self.tree_cache)
            done.append(
                ReqEmbeddingOutput(
                    rid=req.rid,
                    embedding=embedding,
                    finished_reason=req.finished_reason,
                    prompt_tokens=len(req.origin_input_ids),
                    cached_tokens=req.cached_tokens,
                )
            )
        if done:
            self.send_to_tokenizer(BatchEmbeddingOutput(outputs=done))

    def _stream_due(self, req: Req) -> bool:
        """Whether a running stream request reports this step: its first token (time to first
        token never waits), then once ``stream_interval`` tokens are unsent."""
        if not req.stream or req.is_chunked:
            return False
        unsent = len(req.output_ids) - req.send_offset
        interval = req.sampling_params.stream_interval or self.stream_interval
        return req.send_offset == 0 or unsent >= interval

    def finish_now(self, reqs: list[Req], reason: FinishReason) -> None:
        """Finish requests outside a model step (aborted, rejected, out of memory)."""
        for req in reqs:
            req.finished_reason = reason
            if req.req_pool_idx is not None:
                release_kv(req, self.tree_cache)
        self.send_outputs(reqs)

    def send_outputs(self, reqs: list[Req]) -> None:
        if self.on_finish is not None:
            for req in reqs:
                if req.finished():
                    self.on_finish(req)
        if reqs:
            self.send_to_detokenizer(BatchTokenIDOutput(outputs=[make_output(r) for r in reqs]))


def _add_input_logprobs(req: Req, computed: InputLogprobs) -> None:
    """Append what one extend computed; position 0 (nothing precedes it) gets None first."""
    if not req.input_logprobs and req.logprob_start_len == 0:
        req.input_logprobs.append(None)
        req.input_top_logprobs.append(None)
        req.input_token_ids_logprobs.append(None)
    req.input_logprobs.extend(computed.values)
    req.input_top_logprobs.extend(computed.top or [[] for _ in computed.values])
    req.input_token_ids_logprobs.extend(computed.token_ids or [[] for _ in computed.values])
