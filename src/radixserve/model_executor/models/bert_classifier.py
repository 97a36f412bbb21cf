"""Cross-encoders: BERT and XLM-RoBERTa with a sequence-classification head (ms-marco MiniLM
rerankers, bge-reranker, NLI and sentiment classifiers).

The encoder is ``bert.py``'s (same layers, same packed ``qkv_proj``); each request's first token
(``[CLS]`` / ``<s>``) goes through the checkpoint's head and ``embed`` returns the raw logits,
float32 ``[batch_size, num_labels]``, one row per request. They travel through the scheduler as
an embedding model's vectors do; the HTTP layer turns them into rerank scores (``sigmoid`` of a
single logit, as sentence-transformers' ``CrossEncoder`` and vLLM give it) or class
probabilities (``softmax``).

The heads, as in transformers:

- ``BertForSequenceClassification``: ``classifier(tanh(bert.pooler.dense(cls)))``;
- ``XLMRobertaForSequenceClassification``: ``classifier.out_proj(tanh(classifier.dense(cls)))``;
  its positions start at ``pad_token_id + 1`` (RoBERTa's convention for unpadded inputs).

Pair inputs carry their segments in ``ForwardBatch.token_type_ids`` (BERT's tokenizers give
them; XLM-R's give none, so every token is segment 0).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from radixserve.forward_batch import ForwardBatch
from radixserve.model_config import ModelConfig
from radixserve.model_executor.models.bert import (
    BertEmbeddings,
    BertLayer,
    BertModel,
    _padded_layout,
    layer_norm_eps,
)


class _Encoder(nn.Module):
    """``embeddings`` + ``encoder.layer`` of a BERT-style checkpoint (names as in it)."""

    def __init__(self, config: ModelConfig, eps: float) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config, eps)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            BertLayer(config, eps) for _ in range(config.num_hidden_layers)
        )

    def first_tokens(self, forward_batch: ForwardBatch, position_offset: int) -> torch.Tensor:
        """The last hidden state of each request's first token, ``[batch_size, hidden]``."""
        lens = forward_batch.extend_seq_lens_cpu
        assert lens is not None and forward_batch.extend_prefix_lens_cpu is not None
        assert not any(forward_batch.extend_prefix_lens_cpu), "an encoder reuses no prefix"
        input_ids = forward_batch.input_ids
        index, valid = _padded_layout(lens, input_ids.device)
        positions = forward_batch.positions + position_offset
        x = self.embeddings(input_ids, positions, forward_batch.token_type_ids)
        padding = None if min(lens) == max(lens) else valid
        for layer in self.encoder.layer:
            x = layer(x, index, padding)
        starts = torch.tensor([0, *itertools.accumulate(lens)][:-1], device=input_ids.device)
        return x[starts]


class _SequenceClassifier(nn.Module):
    """What both heads share: BERT's fused q/k/v names and the config."""

    packed_modules_mapping = BertModel.packed_modules_mapping

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config


class BertForSequenceClassification(_SequenceClassifier):
    """BERT with its pooler and a linear classifier; ``embed`` gives the logits."""

    def __init__(self, config: ModelConfig, attn_backend: object = None) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.bert = _Encoder(config, layer_norm_eps(config))
        self.bert.pooler = nn.Module()
        self.bert.pooler.dense = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, config.num_labels)

    def embed(self, forward_batch: ForwardBatch) -> torch.Tensor:
        cls = self.bert.first_tokens(forward_batch, position_offset=0)
        return self.classifier(torch.tanh(self.bert.pooler.dense(cls))).float()


class XLMRobertaForSequenceClassification(_SequenceClassifier):
    """XLM-RoBERTa with RoBERTa's classification head; ``embed`` gives the logits."""

    def __init__(self, config: ModelConfig, attn_backend: object = None) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.position_offset = int(config.hf_config.get("pad_token_id", 1)) + 1
        self.roberta = _Encoder(config, layer_norm_eps(config))
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(hidden, hidden)
        self.classifier.out_proj = nn.Linear(hidden, config.num_labels)

    def embed(self, forward_batch: ForwardBatch) -> torch.Tensor:
        cls = self.roberta.first_tokens(forward_batch, self.position_offset)
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(cls))).float()
