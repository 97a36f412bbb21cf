"""Scheduler-side request and batch state, and the step down to the runner's ``ForwardBatch``.

Data flows through three types, each owned by one side of the scheduler/runner seam:

    Req            one request for its whole life: prompt, output so far, sampling parameters,
                   its request-pool row and KV length, the prefix it reuses from the cache,
                   logprobs and what was already sent to the detokenizer.  Python lists, CPU.
      │  admitted by PrefillAdder (schedule_policy.py) or kept running across decode steps
      ▼
    ScheduleBatch  the requests of one model step.  ``prepare_for_extend`` / ``prepare_for_decode``
                   allocate request rows and KV slots (evicting from the prefix cache first when
                   short), write ``req_to_token`` and build the step's tensors on the device,
                   one host→device copy per tensor.
      │  to_forward_batch()
      ▼
    ForwardBatch   plain tensors + SamplingBatchInfo; the model runner never sees a ``Req``.

After the step, ``output_processor.py`` appends the sampled tokens to each ``Req``, decides who
finished and hands finished KV to the prefix cache.  The running set is itself a
``ScheduleBatch`` that finished requests leave at once (``filter_batch``) and a finished prefill
joins (``merge_batch``).

Token accounting of one request (``all_ids = origin_input_ids + output_ids``):

    | counter                 | meaning                                                        |
    |-------------------------|----------------------------------------------------------------|
    | len(prefix_indices)     | leading tokens whose KV is reused: matched in the prefix cache |
    |                         | (locked), or computed by this request's earlier prefill chunks |
    | kv_len                  | leading tokens of ``all_ids`` whose KV exists for this request |
    | len(fill_ids)           | tokens whose KV exists after the current prefill (chunk)       |
    | extend_input_len        | tokens computed by the current prefill: fill - prefix          |

``len(prefix_indices) <= kv_len <= len(all_ids) + tokens_in_flight`` always (asserted). Between
steps a running request has ``kv_len == len(all_ids) - 1``: its newest token's KV is written by
the next decode step. Under the overlap schedule (``scheduler.py``) the next step may be planned
while the current one still runs: its token is then in flight, not yet in ``output_ids``, and
``kv_len == len(all_ids)`` until the token arrives.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixserve.finish_reason import FinishLength, FinishReason, FinishStop
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.managers.io_struct import (
    SessionParams,
    TokenizedGenerateReqInput,
    per_prompt_options,
)
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.req_to_token_pool import ReqToTokenPool
from radixserve.sampling import stop_regex
from radixserve.sampling.sampling_batch_info import GrammarMask, SamplingBatchInfo
from radixserve.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.constrained import GrammarCache
    from radixserve.constrained.limits import TimedMatcher

_EMPTY = torch.empty(0, dtype=torch.int64)
# Every ``Req`` alive in this process, for the internal state's ``num_live_reqs``: once no
# request runs, waits or belongs to an open session it must be 0 (nothing holds on to them).
_LIVE_REQS: weakref.WeakSet[Req] = weakref.WeakSet()


def pages_to_alloc(prefix_len: int, seq_len: int, page_size: int) -> int:
    """KV slots the allocator hands out to grow a request from ``prefix_len`` to ``seq_len``.

    The partial last page of the prefix is filled first, then whole pages are taken.
    """
    return (-(-seq_len // page_size) - -(-prefix_len // page_size)) * page_size


class Req:
    """One generation request (satisfies ``CacheableReq`` and the sessions' ``SessionReq``)."""

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        token_ids_logprob: list[int] | None = None,
        stream: bool = False,
        session_params: SessionParams | None = None,
    ) -> None:
        _LIVE_REQS.add(self)
        self.rid = rid
        self.origin_input_ids = origin_input_ids
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.token_ids_logprob = token_ids_logprob if return_logprob else None
        # Input logprobs for prompt positions [logprob_start_len, len(origin_input_ids)): -1
        # (or the prompt's length) asks for none.
        self.logprob_start_len = logprob_start_len if return_logprob else -1
        self.stream = stream
        self.session_params = session_params
        # Set for a turn of a streaming session: its KV lives in that session's slot.
        self.streaming_session_id: str | None = None
        # The LoRA adapter (lora_requests.bind_lora): its name, pool slot (-1: the base model)
        # and its load's cache namespace (0: the base model's), which keys the radix tree.
        self.lora_path: str | None = None
        self.lora_slot = -1
        self.lora_namespace = 0
        # An encoder's segment ids for origin_input_ids (cross-encoder pairs), else None.
        self.token_type_ids: list[int] | None = None

        # Memory state (see the module docstring's table).
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node: Any = None
        self.fill_ids: list[int] = []
        self.extend_input_len = 0
        self._kv_len = 0
        # Decode steps launched for this request whose token is not appended yet (overlap
        # schedule: at most 2, the step running and the one planned behind it).
        self.tokens_in_flight = 0
        # True while a prefill of this request is cut short (the rest comes in later chunks).
        self.is_chunked = False
        # True once retracted: its next prefill recomputes origin_input_ids + output_ids.
        self.is_retracted = False
        # Constrained decoding: the grammar's compile future while the request waits in the
        # grammar queue, then its matcher (which has accepted exactly ``output_ids``).
        self.grammar_future: Any = None
        self.grammar: TimedMatcher | None = None

        # Reporting.
        self.cached_tokens = 0
        # With the hierarchical cache: how many of cached_tokens were loaded back from the host
        # and from storage ({"host": h, "storage": s}, set by its load_back); None without it.
        self.cached_tokens_tiers: dict[str, int] | None = None
        self.finished_reason: FinishReason | None = None
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.output_token_ids_logprobs: list[list[float]] = []
        # Input logprobs of prompt positions [logprob_start_len, ...), filled chunk by chunk.
        self.input_logprobs: list[float | None] = []
        self.input_top_logprobs: list[list[tuple[int, float]] | None] = []
        self.input_token_ids_logprobs: list[list[float] | None] = []
        self.input_logprobs_sent = False
        self.send_offset = 0  # output_ids[:send_offset] were already sent
        # An abort message, set when an abort arrives while the request holds KV; the scheduler
        # finishes it before the next batch forms.
        self.to_abort: str | None = None
        # Priority scheduling (priority_scheduling.py): the request's priority, set at intake,
        # and when it entered the waiting queue (the waiting timeout counts from there).
        self.priority = 0
        self.queued_at = time.monotonic()

    @classmethod
    def from_message(cls, msg: TokenizedGenerateReqInput, input_ids: list[int]) -> Req:
        """The request ``msg`` asks for, with ``input_ids`` as its prompt (the message's own,
        or the prompt a session assembled from it)."""
        return cls(
            msg.rid,
            input_ids,
            msg.sampling_params,
            session_params=msg.session_params,
            **per_prompt_options(msg),
        )

    # ------------------------------------------------------------------ derived state
    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def kv_len(self) -> int:
        return self._kv_len

    @kv_len.setter
    def kv_len(self, value: int) -> None:
        assert len(self.prefix_indices) <= value <= self.seqlen + self.tokens_in_flight, (
            f"{self.rid}: kv_len {value} outside [prefix {len(self.prefix_indices)}, "
            f"seqlen {self.seqlen} + in flight {self.tokens_in_flight}]"
        )
        self._kv_len = value

    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        """Whether some prompt position's logprob is still to be computed."""
        start = self.logprob_start_len
        return 0 <= start < len(self.origin_input_ids) and not self.input_logprobs_done

    @property
    def input_logprobs_done(self) -> bool:
        return len(self.input_logprobs) == len(self.origin_input_ids) - self.logprob_start_len

    @property
    def max_prefix_len(self) -> int:
        """The longest cached prefix this request may reuse: all but its last token, and no
        position whose logits its input logprobs need (those are recomputed: the cache holds
        KV, not logits)."""
        if self.wants_input_logprobs:
            return max(self.logprob_start_len, 1) - 1
        return self.seqlen - 1

    def input_logprob_rows(self, prefix_len: int, seq_len: int) -> tuple[int, int]:
        """``(first, count)`` of the positions of an extend over ``[prefix_len, seq_len)``
        whose logits give input logprobs: position p scores prompt token p + 1, for tokens
        ``max(logprob_start_len, 1)`` to the prompt's last. ``first`` is relative to the
        extend."""
        if not self.wants_input_logprobs:
            return 0, 0
        lo = max(max(self.logprob_start_len, 1) - 1, prefix_len)
        hi = min(len(self.origin_input_ids) - 1, seq_len)
        return lo - prefix_len, max(hi - lo, 0)

    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)

    # ------------------------------------------------------------------ lifecycle
    def reset_after_retract(self) -> None:
        """Forget all KV state (the cache already took it); outputs are kept."""
        assert self.req_pool_idx is None, "release the request row before resetting"
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.fill_ids = []
        self.extend_input_len = 0
        self._kv_len = 0
        self.is_chunked = False
        self.is_retracted = True

    def check_finished(self, eos_token_ids: set[int], tokenizer: Any) -> None:
        """Set ``finished_reason`` after a token was appended, if the request is done.

        Order: a grammar that is complete (its matcher accepted the model's EOS), the length
        limit, then (not before ``min_new_tokens``) EOS unless ``ignore_eos``,
        ``stop_token_ids``, stop strings and ``stop_regex`` matches found in text this
        request generated.
        """
        if self.finished_reason is not None:
            return
        params = self.sampling_params
        if self.grammar is not None and self.grammar.is_terminated():
            self.finished_reason = FinishStop(matched=self.output_ids[-1])
            return
        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = FinishLength(length=params.max_new_tokens)
            return
        if len(self.output_ids) < params.min_new_tokens:
            return
        last = self.output_ids[-1]
        if (not params.ignore_eos and last in eos_token_ids) or last in params.stop_token_ids:
            self.finished_reason = FinishStop(matched=last)
            return
        if params.stop:
            # A byte-level token carries at least one byte and a character at most four, so
            # this window covers the longest stop string (+1 for a merge at its left edge).
            window = 4 * max(len(s) for s in params.stop) + 1
            tail = tokenizer.decode(
                self.output_ids[-window:], skip_special_tokens=params.skip_special_tokens
            )
            for stop in params.stop:
                if stop in tail:
                    self.finished_reason = FinishStop(matched=stop)
                    return
        if params.stop_regex:
            # RE2 over a window of bounded size: the work per step does not grow with the
            # output, whatever the pattern (sampling/stop_regex.py).
            window = stop_regex.window_tokens(params.stop_regex)
            text = tokenizer.decode(
                self.output_ids[-window:], skip_special_tokens=params.skip_special_tokens
            )
            matched = stop_regex.find_stop_regex(
                params.stop_regex, text, at_start=len(self.output_ids) <= window
            )
            if matched is not None:
                self.finished_reason = FinishStop(matched=matched)


def release_kv(req: Req, tree_cache: BasePrefixCache) -> None:
    """Hand ``req``'s KV to the prefix cache, unlock its prefix and free its row.

    KV slots of the row change hands like this with a radix tree (``cache_finished_req``'s
    contract; the chunk cache frees them all):

        | row range                         | before          | after                       |
        |-----------------------------------|-----------------|-----------------------------|
        | [0, len(prefix_indices))          | cache (locked)  | cache (unlocked)            |
        | [len(prefix), page-aligned kv_len)| request         | cache (duplicates freed)    |
        | [page-aligned kv_len, kv_len)     | request         | freed                       |
    """
    tree_cache.cache_finished_req(req, req.all_ids[: req.kv_len])
    assert req.req_pool_idx is None, "cache_finished_req frees the request row"


def live_reqs() -> list[Req]:
    """The ``Req`` objects alive in this process (running, waiting, or held by a session)."""
    return list(_LIVE_REQS)


def num_live_reqs() -> int:
    """``Req`` objects alive in this process (see ``_LIVE_REQS``)."""
    return len(_LIVE_REQS)


@dataclass(frozen=True)
class BatchResources:
    """What every batch of one scheduler allocates from and builds tensors for."""

    req_to_token_pool: ReqToTokenPool
    allocator: Any  # TokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    device: torch.device
    vocab_size: int
    eos_token_ids: list[int]
    grammars: GrammarCache | None = None  # compiled grammars (their backend fills masks)

    @property
    def page_size(self) -> int:
        return self.allocator.page_size


class ScheduleBatch:
    """The requests of one model step (the running set between steps)."""

    def __init__(self, reqs: list[Req], resources: BatchResources) -> None:
        self.reqs = reqs
        self.resources = resources
        self.forward_mode = ForwardMode.DECODE
        # Step tensors (device), filled by prepare_for_extend / prepare_for_decode.
        self.input_ids: torch.Tensor = _EMPTY
        # Overlap schedule: rows of the step in flight whose tokens are this step's inputs.
        self.input_rows: torch.Tensor | None = None
        self.positions: torch.Tensor = _EMPTY
        self.req_pool_indices: torch.Tensor = _EMPTY
        self.seq_lens: torch.Tensor = _EMPTY
        self.out_cache_loc: torch.Tensor = _EMPTY
        self.seq_lens_cpu: list[int] = []
        self.prefix_lens_cpu: list[int] = []
        self.extend_lens_cpu: list[int] = []

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    # ------------------------------------------------------------------ allocation
    def _alloc_kv(self, num_tokens: int, alloc: Any) -> torch.Tensor:
        """Run ``alloc()`` after evicting enough from the cache; the caller checked capacity."""
        allocator = self.resources.allocator
        if allocator.available_size() < num_tokens:
            self.resources.tree_cache.evict(num_tokens - allocator.available_size())
        out = alloc()
        assert out is not None, (
            f"KV allocation of {num_tokens} tokens failed although admission checked capacity "
            f"(available {allocator.available_size()}, "
            f"evictable {self.resources.tree_cache.evictable_size()})"
        )
        return out

    def _last_locs(self, rows: list[int], lens: list[int]) -> list[int]:
        """KV slot of each request's last token already in its row (-1 when none).

        Only a paged allocator (to continue a partly filled page) or one with decode runs (a
        pool in host memory) reads them; otherwise nothing does, and reading the device's table
        would cost a GPU step a synchronisation."""
        out = [-1] * len(lens)
        if not self.resources.allocator.reads_last_locs:
            return out
        table = self.resources.req_to_token_pool.req_to_token
        idx = [i for i, n in enumerate(lens) if n > 0]
        if idx:
            locs = table[[rows[i] for i in idx], [lens[i] - 1 for i in idx]].tolist()
            for i, loc in zip(idx, locs, strict=True):
                out[i] = loc
        return out

    def _to_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.resources.device, non_blocking=True)

    def prepare_for_extend(self) -> None:
        """Give each admitted request a row and KV slots for ``fill_ids[len(prefix):]``.

        KV slots of request ``r`` after this call (row ``req_to_token[r.req_pool_idx]``):

            | row range                      | slots from                | owner        |
            |--------------------------------|---------------------------|--------------|
            | [0, len(prefix_indices))       | prefix_indices (matched)  | prefix cache |
            | [len(prefix), len(fill_ids))   | allocated here            | the request  |
        """
        resources = self.resources
        self.forward_mode = ForwardMode.EXTEND
        for req in self.reqs:
            if req.req_pool_idx is None:
                req.req_pool_idx = resources.req_to_token_pool.alloc()
                assert req.req_pool_idx is not None, "admission checked free request slots"
        rows = [r.req_pool_idx for r in self.reqs]
        self.prefix_lens_cpu = [len(r.prefix_indices) for r in self.reqs]
        self.seq_lens_cpu = [len(r.fill_ids) for r in self.reqs]
        self.extend_lens_cpu = [
            s - p for s, p in zip(self.seq_lens_cpu, self.prefix_lens_cpu, strict=True)
        ]
        assert all(n > 0 for n in self.extend_lens_cpu), "every prefill computes >= 1 token"

        table = resources.req_to_token_pool.req_to_token
        # Rows of reused prefixes point at the cache's slots.
        with_prefix = [i for i, p in enumerate(self.prefix_lens_cpu) if p > 0]
        if with_prefix:
            prefix_rows = torch.tensor(
                [rows[i] for i in with_prefix], dtype=torch.int64
            ).repeat_interleave(torch.tensor([self.prefix_lens_cpu[i] for i in with_prefix]))
            prefix_cols = torch.cat([torch.arange(self.prefix_lens_cpu[i]) for i in with_prefix])
            prefix_slots = torch.cat([self.reqs[i].prefix_indices for i in with_prefix])
            table[prefix_rows.to(table.device), prefix_cols.to(table.device)] = prefix_slots.to(
                table.device
            )

        num_new = sum(self.extend_lens_cpu)
        need = sum(
            pages_to_alloc(p, s, resources.page_size)
            for p, s in zip(self.prefix_lens_cpu, self.seq_lens_cpu, strict=True)
        )
        last_locs = self._last_locs(rows, self.prefix_lens_cpu)
        self.out_cache_loc = self._alloc_kv(
            need,
            lambda: resources.allocator.alloc_extend(
                self.prefix_lens_cpu, self.seq_lens_cpu, last_locs
            ),
        )
        assert self.out_cache_loc.numel() == num_new

        input_ids: list[int] = []
        positions: list[int] = []
        for req, p, s in zip(self.reqs, self.prefix_lens_cpu, self.seq_lens_cpu, strict=True):
            input_ids.extend(req.fill_ids[p:s])
            positions.extend(range(p, s))
            req.extend_input_len = s - p
            req.kv_len = s
        token_rows = torch.tensor(rows, dtype=torch.int64).repeat_interleave(
            torch.tensor(self.extend_lens_cpu)
        )
        self.input_ids = self._to_device(input_ids)
        self.positions = self._to_device(positions)
        self.req_pool_indices = self._to_device(rows)
        self.seq_lens = self._to_device(self.seq_lens_cpu)
        table[token_rows.to(table.device), self.positions.to(table.device)] = (
            self.out_cache_loc.to(table.device)
        )

    def decode_tokens_needed(self) -> int:
        """KV slots the next decode step takes: a new page for each request whose last is full."""
        page = self.resources.page_size
        return sum(page for r in self.reqs if r.kv_len % page == 0)

    def prepare_for_decode(self, behind: ScheduleBatch | None = None) -> None:
        """One new KV slot per request for its newest token (``output_ids[-1]``).

        ``behind`` (overlap schedule): the step in flight, still sampling those newest tokens.
        ``input_ids`` then stays empty and ``input_rows`` says where each request's token is in
        that step's output; the worker fills ``input_ids`` from it before this step runs.
        """
        resources = self.resources
        self.forward_mode = ForwardMode.DECODE
        rows = [r.req_pool_idx for r in self.reqs]
        kv_lens = [r.kv_len for r in self.reqs]
        self.prefix_lens_cpu = []
        self.extend_lens_cpu = []
        self.seq_lens_cpu = [n + 1 for n in kv_lens]
        last_locs = self._last_locs(rows, kv_lens)
        self.out_cache_loc = self._alloc_kv(
            self.decode_tokens_needed(),
            lambda: resources.allocator.alloc_decode(self.seq_lens_cpu, last_locs),
        )
        if behind is None:
            self.input_ids = self._to_device([r.output_ids[-1] for r in self.reqs])
            self.input_rows = None
        else:
            row_of = {id(r): i for i, r in enumerate(behind.reqs)}
            self.input_ids = _EMPTY
            self.input_rows = self._to_device([row_of[id(r)] for r in self.reqs])
        self.positions = self._to_device(kv_lens)
        self.req_pool_indices = self._to_device(rows)
        self.seq_lens = self._to_device(self.seq_lens_cpu)
        table = resources.req_to_token_pool.req_to_token
        table[self.req_pool_indices.to(table.device), self.positions.to(table.device)] = (
            self.out_cache_loc.to(table.device)
        )
        for req in self.reqs:
            req.kv_len += 1

    # ------------------------------------------------------------------ membership
    def filter_batch(self) -> None:
        """Drop finished requests and those whose prefill is still being chunked."""
        self.reqs = [r for r in self.reqs if not r.finished() and not r.is_chunked]

    def merge_batch(self, other: ScheduleBatch) -> None:
        self.reqs.extend(other.reqs)

    def snapshot(self) -> ScheduleBatch:
        """This step's requests and mode, kept apart from later changes of ``self`` (the
        overlap schedule processes a step's result after the running batch moved on)."""
        copy = ScheduleBatch(list(self.reqs), self.resources)
        copy.forward_mode = self.forward_mode
        return copy

    # ------------------------------------------------------------------ the seam
    def lora_slots(self) -> list[int] | None:
        """Each request's LoRA adapter slot (-1: the base model), or None when none has one."""
        return ([r.lora_slot for r in self.reqs] if any(r.lora_slot >= 0 for r in self.reqs)
                else None)

    def to_forward_batch(self) -> ForwardBatch:
        resources = self.resources
        return_logprob = any(r.return_logprob for r in self.reqs)
        sampling_info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in self.reqs],
            output_ids=[r.output_ids for r in self.reqs],
            input_ids=[r.origin_input_ids for r in self.reqs],
            eos_token_ids=resources.eos_token_ids,
            vocab_size=resources.vocab_size,
            device=resources.device,
            grammar_mask=self._grammar_mask(),
        )
        is_extend = self.forward_mode.is_extend
        forward_batch = ForwardBatch(
            forward_mode=self.forward_mode,
            input_ids=self.input_ids,
            positions=self.positions,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            out_cache_loc=self.out_cache_loc,
            seq_lens_cpu=list(self.seq_lens_cpu),
            extend_prefix_lens_cpu=list(self.prefix_lens_cpu) if is_extend else None,
            extend_seq_lens_cpu=list(self.extend_lens_cpu) if is_extend else None,
            sampling_info=sampling_info,
            return_logprob=return_logprob,
            top_logprobs_nums=[r.top_logprobs_num for r in self.reqs] if return_logprob else None,
            token_ids_logprobs=(
                [r.token_ids_logprob for r in self.reqs]
                if any(r.token_ids_logprob for r in self.reqs) else None
            ),
            lora_slots=self.lora_slots(),
        )
        if is_extend and any(r.token_type_ids for r in self.reqs):  # encoders: whole inputs
            types = [t for r in self.reqs for t in (r.token_type_ids or [0] * r.extend_input_len)]
            forward_batch.token_type_ids = torch.tensor(types, device=self.input_ids.device)
        if is_extend and any(r.wants_input_logprobs for r in self.reqs):
            self._plan_input_logprobs(forward_batch)
        return forward_batch

    def _grammar_mask(self) -> GrammarMask | None:
        """The next-token bitmask of the constrained requests (others allow everything)."""
        rows = [i for i, r in enumerate(self.reqs) if r.grammar is not None]
        if not rows:
            return None
        assert self.resources.grammars is not None, "a request has a grammar, so the cache exists"
        backend = self.resources.grammars.backend
        bitmask = backend.allocate_bitmask(len(self.reqs))
        for i in rows:
            self.reqs[i].grammar.fill_bitmask(bitmask, i)
        return GrammarMask(bitmask, rows, backend.apply_bitmask)

    def _plan_input_logprobs(self, forward_batch: ForwardBatch) -> None:
        """Which positions of this extend give input logprobs, and the tokens they score."""
        starts, counts, targets = [], [], []
        for req, prefix, seq in zip(
            self.reqs, self.prefix_lens_cpu, self.seq_lens_cpu, strict=True
        ):
            first, count = req.input_logprob_rows(prefix, seq)
            starts.append(first)
            counts.append(count)
            begin = prefix + first + 1
            targets.extend(req.origin_input_ids[begin : begin + count])
        forward_batch.input_logprob_starts = starts
        forward_batch.input_logprob_counts = counts
        forward_batch.input_logprob_targets = targets
