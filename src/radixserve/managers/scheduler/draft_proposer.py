"""STANDALONE speculation: a small draft model proposes the tokens (docs/speculative.md).

The draft model has a ``ModelRunner`` of its own (weights, request rows, KV pool with page size
1) on the target's device. Its KV pool has as many token slots as the target's; the target's
pool was planned with the draft's weights and per-token KV bytes taken out of the same budget
(``KVShare``), so the two together fit where the target alone used to.

**Draft state per request.** The draft keeps KV for a prefix ``[0, kv_len)`` of the request's
tokens (``Req.all_ids``), in a row of its own. It does not share the target's radix cache:
whatever it lacks (a new request, or one whose steps ran without speculation) it prefills
itself, in the *catch-up* extend that starts every proposal. That is the simplest choice that is
always consistent: a draft KV slot only ever holds the token the request really has there.

**One proposal** (``propose``): a request with ``L`` tokens (its newest at ``L - 1``) extends the
draft over ``all_ids[kv_len:L]`` (usually one or two tokens; the whole prompt the first time),
whose last logits give draft ``d_1``; then ``room - 1`` batched decode steps give
``d_2 .. d_room``. A greedy request's drafts are the draft model's argmax; a sampled request
draws each from the draft's distribution ``q`` (after its own temperature, top-k, top-p,
min-p), which the verify step hands to the rejection sampler (``speculative/verify.py``), so
the output follows the target's distribution exactly.

**After verification** (``after_verify``): ``a`` drafts were kept, so draft positions
``< L + min(a, room - 1)`` hold the request's real tokens; the slots past it are freed.

**Freeing.** ``sweep`` frees the row and KV of every request that is no longer running
(finished, aborted or retracted); the speculative loop calls it after every step, so an idle
scheduler holds no draft KV. A request whose catch-up does not fit in the draft pool gives up
its draft state and decodes that step without drafts.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.managers.scheduler.schedule_batch import Req, ScheduleBatch
from radixserve.mem_cache.kv_pool import MHATokenToKVPool
from radixserve.model_config import ModelConfig
from radixserve.model_executor.model_loader import checkpoint_weight_bytes
from radixserve.model_executor.model_runner import KVShare, ModelRunner, RunnerSettings
from radixserve.server_args import ServerArgs
from radixserve.speculative import sampling_probs

logger = logging.getLogger(__name__)


def load_draft_config(
    server_args: ServerArgs, target: ModelConfig, device: torch.device
) -> tuple[ModelConfig, KVShare]:
    """The draft model's config, checked against the target's vocabulary, and what it takes
    from the target's memory budget."""
    path = server_args.speculative_draft_model_path
    assert path is not None
    draft = ModelConfig.from_path(
        path, server_args.dtype, device, None, server_args.speculative_draft_model_quantization
    )
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_draft_model_path {path!r} has a vocabulary of {draft.vocab_size} "
            f"tokens, the target {target.vocab_size}: STANDALONE needs the target's tokenizer"
        )
    _check_same_tokenizer(server_args, path)
    weight_bytes = checkpoint_weight_bytes(draft, draft.torch_dtype)
    if draft.quantization is not None:  # int8 weights: a quarter of fp32, half of bf16
        weight_bytes = weight_bytes // draft.torch_dtype.itemsize
    per_token = MHATokenToKVPool.bytes_per_token(
        draft.num_key_value_heads, draft.head_dim, draft.num_hidden_layers, draft.torch_dtype
    )
    return draft, KVShare(weight_bytes, per_token)


def _check_same_tokenizer(server_args: ServerArgs, draft_path: str) -> None:
    """Equal vocabulary sizes can still hide another tokenizer: compare the token tables
    when the draft checkpoint has a tokenizer of its own."""
    from radixserve.tokenizer_loader import load_tokenizer

    if draft_path in (server_args.model_path, server_args.tokenizer):
        return
    try:
        draft_vocab = load_tokenizer(draft_path).get_vocab()
    except Exception:  # no tokenizer files next to the draft's weights: sizes were checked
        logger.info("draft model %s has no tokenizer of its own; vocabulary sizes agree",
                    draft_path)
        return
    if draft_vocab != load_tokenizer(server_args.tokenizer).get_vocab():
        raise ValueError(
            f"speculative_draft_model_path {draft_path!r} has another tokenizer than the "
            "target: STANDALONE needs the target's tokenizer"
        )


def build_draft_runner(
    config: ModelConfig, settings: RunnerSettings, target: ModelRunner
) -> ModelRunner:
    """The draft's runner: as many KV slots and request rows as the target, page size 1 (its
    rejected drafts are freed token by token), no LoRA; an fp8 KV cache under the draft
    checkpoint's own scales (``--quantization-param-path`` is the target's)."""
    draft_settings = dataclasses.replace(
        settings,
        page_size=1,
        max_total_tokens=target.max_total_num_tokens,
        max_running_requests=target.max_running_requests,
        enable_lora=False,
        lora_paths=None,
        quantization_param_path=None,  # the target's layers' scales
    )
    return ModelRunner(config, draft_settings, target.device)


@dataclass(eq=False)
class _DraftState:
    req: Req
    row: int  # the request's row in the draft's req_to_token
    kv_len: int = 0  # draft KV holds all_ids[:kv_len]
    allocated: int = 0  # slots held in the row: [0, allocated)


@dataclass
class Proposal:
    """Each request's drafts, and for a sampled request the draft distribution of each
    (``[len(drafts), vocab]``; None for greedy requests and requests without drafts)."""

    drafts: list[list[int]]
    draft_probs: list[torch.Tensor | None]


class DraftModelProposer:
    """Drafts with a small model; see the module doc."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.context_len = runner.model_config.context_len
        self.states: dict[str, _DraftState] = {}

    # ------------------------------------------------------------------ memory
    def _free(self, state: _DraftState, start: int) -> None:
        if state.allocated > start:
            table = self.runner.req_to_token_pool.req_to_token
            self.runner.token_to_kv_pool_allocator.free(table[state.row, start:state.allocated])
        state.allocated = min(state.allocated, start)
        state.kv_len = min(state.kv_len, start)

    def _release(self, rid: str) -> None:
        state = self.states.pop(rid)
        self._free(state, 0)
        self.runner.req_to_token_pool.free(state.row)

    def sweep(self, running: list[Req]) -> None:
        """Free the draft state of every request not in ``running`` (or finished)."""
        live = {r.rid: r for r in running if not r.finished()}
        for rid, state in list(self.states.items()):
            if live.get(rid) is not state.req:
                self._release(rid)

    def is_empty(self) -> bool:
        """Whether every draft KV slot and row is free (the leak check at idle)."""
        runner = self.runner
        return (
            not self.states
            and runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens
            and runner.req_to_token_pool.available_size() == runner.max_running_requests
        )

    def usage(self) -> dict[str, int]:
        """The draft pool's figures for ``/get_server_info``."""
        runner = self.runner
        free = runner.token_to_kv_pool_allocator.available_size()
        return {
            "spec_draft_total_kv_tokens": runner.max_total_num_tokens,
            "spec_draft_used_kv_tokens": runner.max_total_num_tokens - free,
            "spec_draft_reqs": len(self.states),
        }

    def _state(self, req: Req) -> _DraftState | None:
        state = self.states.get(req.rid)
        if state is not None and state.req is not req:
            self._release(req.rid)
            state = None
        if state is None:
            row = self.runner.req_to_token_pool.alloc()
            if row is None:
                return None
            state = self.states[req.rid] = _DraftState(req, row)
        return state

    def _alloc(self, state: _DraftState, end: int) -> torch.Tensor | None:
        """Slots for positions ``[state.allocated, end)`` of the request's row."""
        n = end - state.allocated
        slots = self.runner.token_to_kv_pool_allocator.alloc(n)
        if slots is None:
            return None
        table = self.runner.req_to_token_pool.req_to_token
        table[state.row, state.allocated:end] = slots.to(table.device)
        state.allocated = end
        return slots

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose(self, batch: ScheduleBatch, rooms: list[int]) -> Proposal:
        """Up to ``rooms[i]`` drafts for request ``i`` of a decode batch prepared by
        ``prepare_for_decode`` (its newest token at ``len(all_ids) - 1``)."""
        self.sweep(batch.reqs)
        reqs = batch.reqs
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor] | None] = [None for _ in reqs]
        active: list[tuple[int, _DraftState, int]] = []  # (index, state, room)
        ext_ids: list[int] = []
        ext_pos: list[int] = []
        ext_locs: list[torch.Tensor] = []
        for i, req in enumerate(reqs):
            length = len(req.all_ids)
            room = min(rooms[i], self.context_len - length)
            if room <= 0:
                continue
            state = self._state(req)
            if state is None:
                continue
            self._free(state, min(state.kv_len, length - 1))  # keep one token to extend
            slots = self._alloc(state, length)
            if slots is None:
                self._release(req.rid)
                continue
            ext_ids += req.all_ids[state.kv_len:length]
            ext_pos += range(state.kv_len, length)
            ext_locs.append(slots)
            active.append((i, state, room))
        if not active:
            return Proposal(drafts, [None] * len(reqs))
        prefix = [s.kv_len for _, s, _ in active]
        lengths = [len(reqs[i].all_ids) for i, _, _ in active]
        logits = self._forward(
            ForwardMode.EXTEND, ext_ids, ext_pos, [s.row for _, s, _ in active], lengths,
            torch.cat(ext_locs), prefix,
        )
        for (_, state, _), length in zip(active, lengths, strict=True):
            state.kv_len = length
        self._choose(logits, [reqs[i] for i, _, _ in active], [drafts[i] for i, _, _ in active],
                     [i for i, _, _ in active], probs)
        step = 1
        while True:  # decode d_{step+1} from d_step for the requests with room left
            going = [(i, s) for i, s, room in active if room > step]
            if not going:
                break
            locs = []
            for _, state in going:
                locs.append(self._alloc(state, state.allocated + 1))
            if any(slot is None for slot in locs):  # the draft pool is full: stop here
                for (_, state), slot in zip(going, locs, strict=True):
                    if slot is not None:
                        self._free(state, state.allocated - 1)
                break
            positions = [len(reqs[i].all_ids) + step - 1 for i, _ in going]
            logits = self._forward(
                ForwardMode.DECODE, [drafts[i][-1] for i, _ in going], positions,
                [s.row for _, s in going], [p + 1 for p in positions], torch.cat(locs), None,
            )
            self._choose(logits, [reqs[i] for i, _ in going], [drafts[i] for i, _ in going],
                         [i for i, _ in going], probs)
            step += 1
        return Proposal(
            drafts, [torch.stack(p) if p is not None else None for p in probs]
        )

    def _forward(
        self, mode: ForwardMode, input_ids: list[int], positions: list[int], rows: list[int],
        seq_lens: list[int], out_locs: torch.Tensor, prefix_lens: list[int] | None,
    ) -> torch.Tensor:
        device = self.runner.device

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device)

        forward_batch = ForwardBatch(
            forward_mode=mode,
            input_ids=dev(input_ids),
            positions=dev(positions),
            req_pool_indices=dev(rows),
            seq_lens=dev(seq_lens),
            out_cache_loc=out_locs.to(device),
            seq_lens_cpu=list(seq_lens),
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=(
                None if prefix_lens is None
                else [s - p for s, p in zip(seq_lens, prefix_lens, strict=True)]
            ),
        )
        logits = self.runner.forward(forward_batch)
        assert isinstance(logits, torch.Tensor)
        return logits

    def _choose(
        self, logits: torch.Tensor, reqs: list[Req], drafts: list[list[int]], indices: list[int],
        probs: list[list[torch.Tensor] | None],
    ) -> None:
        """Append each request's next draft: the argmax (greedy) or a draw from ``q``."""
        greedy = self.runner._sampler.greedy_argmax(logits).tolist()
        for row, (req, out, i) in enumerate(zip(reqs, drafts, indices, strict=True)):
            params = req.sampling_params
            if params.is_greedy:
                out.append(greedy[row])
                continue
            q = sampling_probs(
                logits[row : row + 1], params.temperature, params.top_k, params.top_p,
                params.min_p,
            )[0].cpu()
            q = q / q.sum()
            out.append(int(torch.multinomial(q, 1)))
            if probs[i] is None:
                probs[i] = []
            probs[i].append(q)

    def after_verify(self, batch: ScheduleBatch, drafts: list[list[int]],
                     gained: list[list[int]]) -> None:
        """Keep the draft KV of the drafts the target kept; free the rest (module doc)."""
        for req, draft, kept in zip(batch.reqs, drafts, gained, strict=True):
            state = self.states.get(req.rid)
            if state is None or state.req is not req or not draft:
                continue
            accepted = max(len(kept) - 1, 0)
            # all_ids before the step had state.kv_len tokens; d_1..d_{n-1} have KV
            self._free(state, state.kv_len + min(accepted, len(draft) - 1))
            state.kv_len = state.allocated
