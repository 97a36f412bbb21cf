"""``POST /v1/completions``: one or many prompts (text or token ids) → n generations each.

Prompts are tokenized here (as the TokenizerManager would) so that a request without
``max_tokens`` can be given the rest of the context. Choice ``p * n + j`` is prompt p's j-th
sample. ``logprobs=k`` returns the chosen tokens' logprobs and the top k alternatives per
position. ``echo`` prefixes the prompt text (a token-id prompt decoded without its special
tokens, as SGLang and vLLM echo it); with ``logprobs`` it also returns the prompt tokens'
logprobs, first in the list (as OpenAI, SGLang and vLLM do). A stream sends the echo, and the
prompt's logprobs, with each choice's first chunk.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from radixserve.server.admission import admit, check_priority, num_prompts
from radixserve.server.context import ServerContext, get_ctx
from radixserve.server.generations import merged_choices
from radixserve.server.off_loop import run_sized
from radixserve.server.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ResponseIds,
    finish_reason_name,
    matched_stop,
)
from radixserve.server.openai.streaming import Delta, Reply
from radixserve.server.parsed_body import ParsedBodyRoute

router = APIRouter(route_class=ParsedBodyRoute)  # parsed_body.py


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    ctx = get_ctx(request)
    lora = ctx.lora_of_model(body.model)
    admit(request, num_prompts(body.prompt), body.n, priority=body.priority)
    check_priority(ctx.server_args, body.priority)
    prompts = await run_sized(request, _prompt_ids, ctx, body.prompt)  # off_loop.py
    prompt_logprobs = body.echo and body.logprobs is not None
    inputs = body.generate_inputs(prompts, ctx.context_len, body.logprobs,
                                  prompt_logprobs=prompt_logprobs,
                                  max_completion_tokens=ctx.server_args.max_completion_tokens)
    for obj in inputs:
        obj.lora_path = lora
    reply = _CompletionReply(ctx, body, ResponseIds.new("cmpl", ctx.model_name), len(inputs))
    return await reply.send(request, merged_choices(ctx.tokenizer_manager, inputs))


def _prompt_ids(ctx: ServerContext, prompt: Any) -> list[list[int]]:
    """Every prompt of the request as token ids (strings tokenized like the TokenizerManager)."""
    if isinstance(prompt, str):
        return [ctx.tokenizer.encode(prompt)]
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    return [ctx.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def _echo(ctx: ServerContext, body: CompletionRequest, choice: int) -> str:
    """What choice ``choice`` starts with: its prompt's text with ``echo``, else nothing.
    Called once the choice has output, so a token-id prompt was checked before it is decoded."""
    return _prompt_text(ctx, body.prompt, choice // body.n) if body.echo else ""


def _prompt_text(ctx: ServerContext, prompt: Any, index: int) -> str:
    """The text of prompt ``index``: token-id prompts are decoded without their special tokens
    (a leading BOS the client sent is not part of the text)."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(x, int) for x in prompt):
        return ctx.tokenizer.decode(prompt, skip_special_tokens=True)
    item = prompt[index]
    return item if isinstance(item, str) else ctx.tokenizer.decode(item, skip_special_tokens=True)


def _logprobs(
    ctx: ServerContext, body: CompletionRequest, meta: dict[str, Any], start: int, offset: int,
    with_prompt: bool = False,
) -> tuple[CompletionLogprobs, int]:
    """Legacy-completions logprobs of output tokens from ``start`` on, text offsets from
    ``offset``, and the offset after them; ``with_prompt`` puts the prompt's tokens first, at
    offsets from 0 in the echoed text. Offsets add up each token's own text, the same whether
    the choice streams or not."""
    result = CompletionLogprobs()
    if with_prompt:
        _add_logprobs(ctx, result, meta["input_token_logprobs"],
                      meta.get("input_top_logprobs") or [], 0, True)
    tops = (meta.get("output_top_logprobs") or [])[start:]
    end = _add_logprobs(ctx, result, meta.get("output_token_logprobs", [])[start:], tops,
                        offset, body.skip_special_tokens)
    return result, end


def _add_logprobs(
    ctx: ServerContext, result: CompletionLogprobs, entries: list[Any],
    tops: list[Any], offset: int, skip_special_tokens: bool,
) -> int:
    """Append ``[logprob, id, text]`` entries; a token advances the offset by the characters
    it adds to the choice's text (none for a special token the text leaves out)."""
    tok = ctx.tokenizer
    for k, (lp, tid, _) in enumerate(entries):
        result.tokens.append(tok.decode([tid]))
        result.token_logprobs.append(lp)
        result.text_offset.append(offset)
        offset += len(tok.decode([tid], skip_special_tokens=skip_special_tokens))
        top = (tops[k] if k < len(tops) else None) or []
        # The prompt's first token has no logprob and no alternatives.
        result.top_logprobs.append(None if lp is None else {tok.decode([t]): v for v, t, _ in top})
    return offset


class _CompletionReply(Reply[CompletionRequest]):
    """Completion choices: the generated text, after the prompt's with ``echo``."""

    response_type = CompletionResponse
    chunk_type = CompletionStreamResponse

    def __init__(self, ctx: ServerContext, body: CompletionRequest, ids: ResponseIds,
                 num_choices: int) -> None:
        super().__init__(body, ids, num_choices)
        self.ctx = ctx
        self.offsets: dict[int, int] = {}  # streamed choice → text offset of its next token

    def choice(self, index: int, out: dict[str, Any]) -> CompletionChoice:
        ctx, body = self.ctx, self.body
        reason = out["meta_info"]["finish_reason"]
        prefix = _echo(ctx, body, index)
        logprobs = None
        if body.logprobs is not None:
            logprobs, _ = _logprobs(ctx, body, out["meta_info"], 0, len(prefix), body.echo)
        return CompletionChoice(
            index=index,
            text=prefix + out["text"],
            logprobs=logprobs,
            finish_reason=finish_reason_name(reason),
            matched_stop=matched_stop(reason),
        )

    def delta_choice(self, delta: Delta) -> CompletionChoice | None:
        ctx, body, offsets = self.ctx, self.body, self.offsets
        reason = delta.finish_reason
        # The echo rides the choice's first chunk, with the prompt's logprobs (SGLang's order).
        first = delta.index not in offsets
        prefix = _echo(ctx, body, delta.index) if first else ""
        offsets.setdefault(delta.index, len(prefix))
        logprobs = None
        if body.logprobs is not None:
            meta = delta.out["meta_info"]
            logprobs, offsets[delta.index] = _logprobs(
                ctx, body, meta, delta.tokens_sent, offsets[delta.index], body.echo and first)
        text = prefix + delta.new_text
        if reason is None and not text and not (logprobs and logprobs.tokens):
            return None
        return CompletionChoice(
            index=delta.index,
            text=text,
            logprobs=logprobs,
            finish_reason=finish_reason_name(reason),
            matched_stop=matched_stop(reason),
        )
