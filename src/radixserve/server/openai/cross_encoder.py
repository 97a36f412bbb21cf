"""How ``/v1/rerank`` and ``/v1/classify`` run on the model a server serves.

Two kinds of model can score a (query, document) pair:

- a sequence classifier (``BertForSequenceClassification``, ``XLMRobertaForSequenceClassification``,
  ``model_config.is_classifier``): each input (a text, or a pair tokenized as one sequence with
  its segment ids, as the checkpoint's tokenizer builds it) runs through the scheduler like an
  embedding, and its vector is the head's logits (``classifier_logits``);
- a decoder reranker that answers "yes" or "no" (Qwen3-Reranker): chosen by its ``config.json``
  naming the two answer tokens in vLLM's key, ``"classifier_from_token": ["no", "yes"]``. Each
  document makes a prompt in Qwen3-Reranker's format and runs as a one-token generation asking
  for the two tokens' logprobs (as ``/v1/score`` does, so a shared query prefix is cached); the
  score is ``p(yes) / (p(yes) + p(no))``, i.e. ``sigmoid(logit_yes - logit_no)``
  (``yes_no_scores``).

Anything else is a 400 that says why (``rerank_kind``, ``check_classifier``).
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import Request

from radixserve.managers.tokenizer.generate_request import GenerateReqInput
from radixserve.server.context import ServerContext
from radixserve.server.errors import APIError
from radixserve.server.generations import cancel_on_disconnect, collect_final, merge_generations
from radixserve.server.off_loop import run_for_size

# Qwen3-Reranker's prompt (its model card), filled with the query and each document.
_QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
_QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

CLASSIFIER = "classifier"
YES_NO = "yes_no"


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    weights = [math.exp(x - top) for x in xs]
    total = sum(weights)
    return [w / total for w in weights]


def rerank_kind(ctx: ServerContext) -> str:
    """``CLASSIFIER`` or ``YES_NO``; a 400 naming why this server's model cannot rerank."""
    config = ctx.tokenizer_manager.model_config
    if config.is_classifier:
        if config.num_labels != 1:
            raise APIError(400, f"this model is a classifier with {config.num_labels} labels; "
                           "reranking needs a one-label cross-encoder (use /v1/classify)")
        return CLASSIFIER
    if ctx.tokenizer_manager.is_generation and "classifier_from_token" in config.hf_config:
        return YES_NO
    what = ("an embedding model" if not ctx.tokenizer_manager.is_generation
            else "a generation model without \"classifier_from_token\" in its config.json")
    raise APIError(400, f"this server's model cannot rerank: it is {what}, not a cross-encoder "
                   "(BertForSequenceClassification, XLMRobertaForSequenceClassification) nor a "
                   "yes/no decoder reranker")


def check_classifier(ctx: ServerContext) -> None:
    """400 unless the model is a sequence classifier."""
    config = ctx.tokenizer_manager.model_config
    if not config.is_classifier:
        raise APIError(400, f"this server's model ({config.architecture}) is not a sequence "
                       "classifier: /v1/classify needs BertForSequenceClassification or "
                       "XLMRobertaForSequenceClassification")


async def check_query(ctx: ServerContext, query: str) -> None:
    """400 naming ``query`` when it alone is longer than the context: it is joined to every
    document, so it would be tokenized once per document (2,048 copies of an 8 MB query)
    only for every pair to be refused (tokenized off the event loop once large)."""
    length = len(await run_for_size(len(query), ctx.tokenizer.encode, query))
    if length > ctx.context_len:
        raise APIError(400, f"query has {length} tokens: more than the context of "
                       f"{ctx.context_len}", param="query")


async def classifier_logits(
    ctx: ServerContext, request: Request, inputs: list[str | tuple[str, str]]
) -> tuple[list[list[float]], int]:
    """Each input's logits (a pair is tokenized as one sequence) and the tokens they took.
    The inputs are tokenized and prepared off the event loop once large (``off_loop.py``)."""
    size = sum(sum(map(len, x)) if isinstance(x, tuple) else len(x) for x in inputs)
    prepared = await run_for_size(size, _prepare_classifier, ctx, inputs)
    work = ctx.tokenizer_manager.encode_request(prepared)
    outputs = await cancel_on_disconnect(request, work)
    if isinstance(outputs, dict):
        outputs = [outputs]
    tokens = sum(out["meta_info"]["prompt_tokens"] for out in outputs)
    return [out["embedding"] for out in outputs], tokens


def _prepare_classifier(ctx: ServerContext, inputs: list[str | tuple[str, str]]) -> Any:
    """Every input tokenized (a pair as one sequence, with its segment ids for BERT) and
    prepared for the scheduler (``TokenizerManager.prepare_embedding``)."""
    tokenizer = ctx.tokenizer
    with_types = ctx.tokenizer_manager.model_config.architecture == "BertForSequenceClassification"
    ids, types = [], []
    for item in inputs:
        enc = tokenizer(*item) if isinstance(item, tuple) else tokenizer(item)
        ids.append(list(enc["input_ids"]))
        given = enc.get("token_type_ids") if with_types else None
        types.append(list(given) if given is not None else [0] * len(enc["input_ids"]))
    obj = GenerateReqInput(input_ids=ids)
    return ctx.tokenizer_manager.prepare_embedding(obj, types if with_types else None)


def yes_no_prompt(ctx: ServerContext, query: str, document: str) -> list[int]:
    """Token ids of Qwen3-Reranker's prompt for one (query, document) pair."""
    body = f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return ctx.tokenizer.encode(_QWEN3_PREFIX + body + _QWEN3_SUFFIX, add_special_tokens=False)


def answer_token_ids(ctx: ServerContext) -> tuple[int, int]:
    """The ids of the config's ``classifier_from_token`` ("no", "yes"): one token each."""
    names = ctx.tokenizer_manager.model_config.hf_config["classifier_from_token"]
    if not (isinstance(names, list) and len(names) == 2):
        raise APIError(400, "config.json's classifier_from_token must name two tokens, the "
                       f"answers no and yes; it is {names!r}")
    ids = []
    for name in names:
        found = ctx.tokenizer.encode(name, add_special_tokens=False)
        if len(found) != 1:
            raise APIError(400, f"classifier_from_token {name!r} is {len(found)} tokens for "
                           "this tokenizer, not one")
        ids.append(found[0])
    return ids[0], ids[1]


async def yes_no_scores(
    ctx: ServerContext, request: Request, query: str, documents: list[str]
) -> tuple[list[float], int]:
    """``p(yes)`` over the two answers after each document's prompt, and the prompt tokens."""
    no_id, yes_id = answer_token_ids(ctx)

    def prepare() -> list[Any]:  # every prompt tokenized and validated before any is sent
        return [ctx.tokenizer_manager.prepare_generate(GenerateReqInput(
                    input_ids=yes_no_prompt(ctx, query, doc),
                    sampling_params={"max_new_tokens": 1, "temperature": 0},
                    return_logprob=True, token_ids_logprob=[no_id, yes_id]))
                for doc in documents]

    size = sum(len(query) + len(doc) for doc in documents)
    prepared = await run_for_size(size, prepare)  # off the event loop once large: off_loop.py
    merged = merge_generations([ctx.tokenizer_manager.generate_request(p) for p in prepared])
    outputs = await cancel_on_disconnect(request, collect_final(merged, len(prepared)))
    scores = []
    for out in outputs:
        (by_id,) = out["meta_info"]["output_token_ids_logprobs"][:1]
        logprob = {int(tid): lp for lp, tid, _ in by_id}
        scores.append(sigmoid(logprob[yes_id] - logprob[no_id]))
    return scores, sum(out["meta_info"]["prompt_tokens"] for out in outputs)
