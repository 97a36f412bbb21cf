"""One prompt of a call turned into the scheduler's message: tokenized, checked
(``request_checks``) and held to the server's bounds on what one generation may cost.

The TokenizerManager calls it for every prompt before anything of the call is registered or
sent, so each ``ValueError`` here fails the whole call with nothing running.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import msgspec

from radixserve.managers.io_struct import (
    SessionParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    per_prompt_options,
)
from radixserve.managers.request_checks import check_embedding, check_generate
from radixserve.managers.tokenizer.generate_request import GenerateReqInput
from radixserve.managers.tokenizer.request_values import describe, find_unrepresentable
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.sessions.session import check_session_id


@dataclass(eq=False)
class RequestTokenizer:
    """Turns one prompt into its scheduler message (see the module docstring). The bounds are
    the server's ``--max-completion-tokens``, ``--max-top-logprobs-num`` and ``--dp-size`` (a
    request naming a replica that does not exist is refused)."""

    tokenizer: Any
    vocab_size: int
    context_len: int
    _: KW_ONLY
    max_completion_tokens: int
    max_top_logprobs_num: int
    dp_size: int
    enable_lora: bool = False
    enable_priority_scheduling: bool = False
    # The LoRA adapters the scheduler holds, name → path (lora_client.py keeps it current).
    lora_adapters: dict[str, str] = field(default_factory=dict)

    def embedding(
        self, obj: GenerateReqInput, token_type_ids: list[int] | None = None
    ) -> TokenizedEmbeddingReqInput:
        """The scheduler message of one input to embed (``token_type_ids``: its ids' segments,
        one per id, for a cross-encoder's pair)."""
        if obj.input_ids is not None:
            input_ids = list(obj.input_ids)
        else:
            input_ids = self.encode_text(obj.text)
        check_embedding(input_ids, vocab_size=self.vocab_size, context_len=self.context_len)
        if token_type_ids is not None and len(token_type_ids) != len(input_ids):
            raise ValueError(f"{len(token_type_ids)} token_type_ids for {len(input_ids)} tokens")
        return TokenizedEmbeddingReqInput(rid=obj.rid, input_ids=input_ids, input_text=obj.text,
                                          token_type_ids=token_type_ids)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a prompt; ``ValueError`` for text the tokenizer cannot read (a lone
        surrogate from an ``Engine`` caller: the HTTP layer refuses those first)."""
        found = find_unrepresentable(text)
        if found is not None:
            raise ValueError(describe("text", found[1]))
        return self.tokenizer.encode(text)

    def generate(self, obj: GenerateReqInput, index: int | None) -> TokenizedGenerateReqInput:
        """Build the scheduler message of one prompt; ``ValueError`` names the batch index."""
        try:
            return self._generate_one(obj)
        except ValueError as e:
            if index is None:
                raise
            raise ValueError(f"prompt {index}: {e}") from e

    def _generate_one(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        if obj.input_ids is not None:
            input_ids = list(obj.input_ids)
        else:
            input_ids = self.encode_text(obj.text)
        sampling_params = SamplingParams.from_dict(obj.sampling_params)
        if (obj.sampling_params or {}).get("max_new_tokens") is None:
            # The native default (128) is clamped to --max-completion-tokens, not refused by it.
            sampling_params.max_new_tokens = min(
                sampling_params.max_new_tokens, self.max_completion_tokens
            )
            sampling_params.validate()
        # A session request's whole prompt is known in the scheduler, which checks it again.
        check_generate(
            input_ids, sampling_params,
            vocab_size=self.vocab_size, context_len=self.context_len,
            return_logprob=obj.return_logprob, logprob_start_len=obj.logprob_start_len,
            top_logprobs_num=obj.top_logprobs_num, token_ids_logprob=obj.token_ids_logprob,
            whole_prompt=not obj.session_params,
        )
        self._check_amplification(obj, sampling_params)
        rank = obj.data_parallel_rank
        if rank is not None and rank >= self.dp_size:
            raise ValueError(
                f"data_parallel_rank {rank} does not exist: --dp-size is "
                f"{self.dp_size} (ranks 0 to {self.dp_size - 1})"
            )
        self._check_lora(obj.lora_path)
        self._check_priority(obj.priority)
        session_params = None
        if obj.session_params:
            try:
                session_params = msgspec.convert(obj.session_params, SessionParams)
            except msgspec.ValidationError as e:
                raise ValueError(f"invalid session_params: {e}") from e
            check_session_id(session_params.id)
        return TokenizedGenerateReqInput(
            rid=obj.rid,
            input_ids=input_ids,
            sampling_params=sampling_params,
            input_text=obj.text,
            session_params=session_params,
            data_parallel_rank=rank,
            lora_path=obj.lora_path,
            priority=obj.priority,
            **per_prompt_options(obj),
        )

    def _check_priority(self, priority: int | None) -> None:
        """A priority needs priority scheduling (refused, not ignored, without it) and must
        fit in the int64 that carries it to the scheduler."""
        if priority is None:
            return
        if not self.enable_priority_scheduling:
            raise ValueError("priority needs a server started with --enable-priority-scheduling")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must fit in 64 bits, got {priority}")

    def _check_lora(self, lora_path: str | None) -> None:
        """An adapter the request names must be loaded (the scheduler checks again: it may be
        unloaded meanwhile)."""
        if lora_path is None:
            return
        if not self.enable_lora:
            raise ValueError("lora_path needs a server started with --enable-lora")
        if lora_path not in self.lora_adapters:
            loaded = ", ".join(sorted(self.lora_adapters)) or "none"
            raise ValueError(f"no LoRA adapter named {lora_path!r} is loaded (loaded: {loaded})")

    def _check_amplification(self, obj: GenerateReqInput, params: SamplingParams) -> None:
        """Bounds on what one generation may cost: ``--max-completion-tokens`` and
        ``--max-top-logprobs-num`` (a reply grows by that many entries per token, for
        ``top_logprobs_num`` and for ``token_ids_logprob`` alike)."""
        cap = self.max_completion_tokens
        if params.max_new_tokens > cap:
            raise ValueError(
                f"max_new_tokens (max_tokens) is {params.max_new_tokens}: this server generates "
                f"at most {cap} tokens per request (--max-completion-tokens)"
            )
        top = self.max_top_logprobs_num
        if obj.top_logprobs_num > top:
            raise ValueError(
                f"top_logprobs_num is {obj.top_logprobs_num}: at most {top} top logprobs per "
                "position (--max-top-logprobs-num)"
            )
        asked = len(obj.token_ids_logprob or [])
        if asked > top:  # the same growth per position as top_logprobs_num
            raise ValueError(
                f"token_ids_logprob has {asked} ids: at most {top} logprobs per position "
                "(--max-top-logprobs-num)"
            )
