"""Admission of generation requests, judged on the parsed body: how many generations it asks for.

A request asks for ``prompts × n`` generations. Once a generation route has parsed its body it
calls ``admit``, which answers

- 400 naming the field past ``--max-n`` (samples per prompt) or ``--max-batch-size`` (prompts
  in one request), or when the request alone asks for more generations than
  ``--max-queued-requests`` could ever admit;
- 429 with ``Retry-After`` while the generations in flight plus these would pass
  ``--max-queued-requests``; with ``--enable-priority-scheduling``, unless waiting requests
  less important than this one can make room: those are evicted (they end with a 503, as
  SGLang's) and this one is admitted (``managers/tokenizer/queue_eviction.py``). Until the
  evicted responses have ended, moments later, the count exceeds the limit by this request;

and otherwise counts them in flight until the response has ended (streams included): the
``RequestGuard`` hands each generation request a ``Ticket`` and gives its generations back when
the app returns. Counting after parsing means a client cannot get past the limit by sending its
body slowly, and counting generations means ``n`` or a batch cannot multiply one request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from radixserve.server.errors import APIError

TICKET_KEY = "radixserve.admission"
RETRY_AFTER_S = 1


@dataclass
class Ticket:
    """The generations one HTTP request has been admitted with (0 until ``admit``)."""

    generations: int = 0


def num_prompts(prompt: Any) -> int:
    """Prompts in a ``text``/``input_ids``/``prompt``/``input`` value: a string or one list of
    token ids is one, any other list one per item. Shapes are checked later, not here."""
    if isinstance(prompt, list) and prompt and not all(isinstance(x, int) for x in prompt):
        return len(prompt)
    return 1


def requested_n(sampling_params: Any) -> int:
    """``n`` of native sampling params (a dict or one per prompt): the largest integer given;
    malformed values count as 1 and are refused later, when the request is normalized."""
    dicts = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    values = [d.get("n") for d in dicts if isinstance(d, dict)]
    return max([v for v in values if isinstance(v, int) and not isinstance(v, bool)], default=1)


def check_batch_size(args: Any, prompts: int, prompt_param: str) -> None:
    """400 past ``--max-batch-size`` prompts in one request (generations and ``/tokenize``)."""
    if prompts > args.max_batch_size:
        raise APIError(
            400, f"the request has {prompts} prompts: at most {args.max_batch_size} in one "
            "request (--max-batch-size)", param=prompt_param,
        )


def admit(request: Request, prompts: int, n: int = 1, prompt_param: str = "prompt",
          priority: int | None = None) -> None:
    """Admit ``prompts × n`` generations for ``request`` or raise the ``APIError`` above
    (``priority``: the one the request names, which a full queue is judged by)."""
    ctx = request.app.state.ctx
    args = ctx.server_args
    if n > args.max_n:
        raise APIError(400, f"n is {n}: at most {args.max_n} samples per prompt (--max-n)",
                       param="n")
    check_batch_size(args, prompts, prompt_param)
    generations = prompts * n
    limit = args.max_queued_requests
    if limit is not None:
        if generations > limit:
            raise APIError(
                400, f"the request asks for {generations} generations (prompts × n) and at most "
                f"{limit} may be in flight (--max-queued-requests)", param="n",
            )
        shortage = ctx.queued_generations + generations - limit
        if shortage > 0 and not (args.enable_priority_scheduling and
                                 ctx.tokenizer_manager.evict_for_priority(priority, shortage)):
            raise APIError(
                429, f"Too many generations in flight ({ctx.queued_generations}; this request "
                f"asks for {generations}, the limit is {limit}); retry later.",
                code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)},
            )
    ticket: Ticket = request.scope[TICKET_KEY]
    ticket.generations += generations
    ctx.queued_generations += generations


def check_priority(args: Any, priority: int | None) -> None:
    """400 naming ``priority`` when the server runs without --enable-priority-scheduling:
    the field is refused, never ignored (docs/priority.md)."""
    if priority is not None and not args.enable_priority_scheduling:
        raise APIError(400, "priority needs a server started with --enable-priority-scheduling",
                       param="priority")
