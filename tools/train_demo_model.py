#!/usr/bin/env python
"""Train the small demo model that ships with radixserve (``models/radixserve-demo``).

The model exists so that ``make serve`` answers with readable (if not very smart) English and so
that the test-suite has a real Hugging Face checkpoint to compare the engine against. Everything
it needs is available offline on any machine with Python:

* **Corpus** - the standard library's own documentation: the pydoc topic pages
  (``pydoc_data.topics.topics``), the docstrings of the built-in functions and types, and the
  docstrings of every standard-library module and of its public classes, functions and methods.
  Source files are parsed with :mod:`ast` (never imported) so collecting the corpus has no side
  effects. Test packages, IDLE, demos and bundled third-party code are skipped. Documents are
  deduplicated and sorted, then shuffled with the seed; about 2% are held out for validation.
  Short chat conversations (``What is ...?`` / ``How do I ...?``) are derived from the documents so
  that a chat prompt is answered with English text about Python.
* **Tokenizer** - a byte-level BPE (``tokenizers`` library) trained on the training documents,
  with the special tokens ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` and the chat-role tokens
  ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|end|>``.
* **Model** - a ``LlamaForCausalLM`` (GQA, tied embeddings, RoPE) of about 7M parameters, trained
  with plain PyTorch (AdamW, linear warmup + cosine decay, gradient clipping, bf16 autocast on
  CPU) on packed sequences of ``<|bos|> document <|eos|>``.

Data order and initialisation depend only on ``--seed``. ``--minutes`` is a wall-clock budget
for the training loop. The learning-rate schedule follows ``--max-steps``, so a run that finishes
its steps inside the budget is reproducible step for step; on a machine too slow (or too busy) to
do so, the schedule follows the clock instead, so that the learning rate still anneals and the
run still ends on time (it then stops after fewer steps, which the log reports). With
``--max-steps 0`` the run always trains for exactly the time budget.

Example (the command used for the shipped checkpoint is recorded in its README)::

    python tools/train_demo_model.py --out models/radixserve-demo --seed 0 --max-steps 850 \\
        --minutes 38
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import math
import os
import random
import re
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END]

# Jinja chat template: <|bos|><|system|>...<|end|><|user|>...<|end|><|assistant|>...<|end|>
# With add_generation_prompt the prompt ends with <|assistant|>; the model then writes the answer
# and closes it with <|end|>, which is one of the EOS ids in generation_config.json.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] | trim }}{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# Directory names under the stdlib that are tests, demos, tools or vendored code.
SKIP_DIRS = {
    "__pycache__",
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "idlelib",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "pydoc_data",
    "__phello__",
    "lib-dynload",
}

# First words of an imperative docstring summary that make a sensible "How do I ...?" question.
HOWTO_VERBS = {
    "add", "append", "apply", "build", "calculate", "call", "cancel", "change", "check",
    "clear", "close", "combine", "compare", "compile", "compress", "compute", "connect",
    "convert", "copy", "count", "create", "decode", "decompress", "delete", "determine",
    "disable", "download", "dump", "enable", "encode", "escape", "evaluate", "execute",
    "extract", "fetch", "find", "flush", "format", "generate", "get", "handle", "import",
    "insert", "install", "join", "list", "load", "lock", "make", "match", "merge", "move",
    "normalize", "open", "pack", "parse", "print", "quote", "read", "receive", "register",
    "remove", "rename", "replace", "reset", "resolve", "restore", "run", "save", "search",
    "send", "serialize", "set", "sort", "split", "start", "stop", "strip", "test",
    "translate", "truncate", "unpack", "update", "validate", "wait", "walk", "write",
}  # fmt: skip


@dataclass(frozen=True)
class Document:
    """One unit of training text: an optional heading line and the documentation body."""

    name: str
    heading: str
    body: str
    kind: str  # "topic", "module", "class", "function"

    def text(self) -> str:
        return f"{self.heading}\n\n{self.body}" if self.heading else self.body


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def collect_topic_docs() -> list[Document]:
    """The pydoc topic pages (language reference sections) shipped with every Python."""
    from pydoc_data.topics import topics

    return [
        Document(name=key, heading="", body=text.strip(), kind="topic")
        for key, text in sorted(topics.items())
        if text.strip()
    ]


def _signature_of(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"


# Compiled modules that are tests, need a terminal/GUI, or only exist as build examples.
SKIP_COMPILED = {"readline", "_tkinter", "_curses", "_curses_panel", "xxlimited", "xxsubtype"}


def compiled_module_names(stdlib: Path) -> list[str]:
    """Built-in and ``lib-dynload`` extension modules (no Python source to parse), sorted."""
    names = set(sys.builtin_module_names)
    dynload = stdlib / "lib-dynload"
    if dynload.is_dir():
        names.update(f.name.split(".")[0] for f in dynload.iterdir() if f.suffix in {".so", ".pyd"})
    return sorted(
        n
        for n in names
        if n not in SKIP_COMPILED and not n.startswith(("_test", "_xx", "xx", "_ctypes_test"))
    )


def _docs_from_object(module: str, obj: object, name: str) -> list[Document]:
    doc = inspect.getdoc(obj)
    qualname = name if module == "builtins" else f"{module}.{name}"
    if isinstance(obj, type):
        if issubclass(obj, BaseException) and obj is not BaseException:
            return []  # exception docstrings are short and repetitive
        docs = [Document(qualname, f"class {qualname}", doc, "class")] if doc else []
        for attr, member in sorted(vars(obj).items()):
            member_doc = None if attr.startswith("_") else inspect.getdoc(member)
            if member_doc and callable(member):
                heading = f"{qualname}.{attr}{_signature_of(member)}"
                docs.append(Document(f"{qualname}.{attr}", heading, member_doc, "function"))
        return docs
    if doc and callable(obj):
        return [Document(qualname, f"{qualname}{_signature_of(obj)}", doc, "function")]
    return []


def collect_compiled_docs(stdlib: Path) -> list[Document]:
    """Docstrings of compiled modules (``builtins``, ``math``, ``_io``...), read with inspect.

    These modules have no Python source, so they are imported; importing a C extension module
    has no side effects beyond loading it (the few that touch the terminal or GUI are skipped).
    """
    docs: list[Document] = []
    for module_name in compiled_module_names(stdlib):
        try:
            module = importlib.import_module(module_name)
        except Exception:  # optional modules may be missing or broken
            continue
        module_doc = inspect.getdoc(module)
        if module_doc and module_name != "builtins":
            docs.append(Document(module_name, f"Module {module_name}", module_doc, "module"))
        for name in sorted(dir(module)):
            obj = getattr(module, name, None)
            if name.startswith("_") or not (inspect.isbuiltin(obj) or isinstance(obj, type)):
                continue
            if module_name != "builtins" and getattr(obj, "__module__", None) == "builtins":
                continue
            docs.extend(_docs_from_object(module_name, obj, name))
    return docs


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def iter_stdlib_files(root: Path) -> Iterator[Path]:
    """Standard-library ``.py`` files in sorted order, without tests, demos and vendored code."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIP_DIRS and not d.startswith(("test", "config-", "."))
        )
        for filename in sorted(filenames):
            if filename.endswith(".py") and not filename.startswith(("test_", "_test")):
                if filename.startswith("_sysconfigdata"):
                    continue
                yield Path(dirpath) / filename


def _docs_from_source(module: str, source: str) -> list[Document]:
    tree = ast.parse(source)
    docs: list[Document] = []
    module_doc = ast.get_docstring(tree, clean=True)
    if module_doc:
        docs.append(Document(module, f"Module {module}", module_doc, "module"))

    def visit(body: list[ast.stmt], prefix: str, depth: int) -> None:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_"):
                continue
            qualname = f"{prefix}.{node.name}"
            doc = ast.get_docstring(node, clean=True)
            if isinstance(node, ast.ClassDef):
                bases = ", ".join(ast.unparse(base) for base in node.bases)
                heading = f"class {qualname}({bases})" if bases else f"class {qualname}"
                if doc:
                    docs.append(Document(qualname, heading, doc, "class"))
                if depth == 0:
                    visit(node.body, qualname, depth + 1)
            elif doc:
                args = ast.unparse(node.args)
                docs.append(Document(qualname, f"{qualname}({args})", doc, "function"))

    visit(tree.body, module, 0)
    return docs


def collect_stdlib_docs(root: Path) -> list[Document]:
    """Docstrings of stdlib modules and their public classes/functions, parsed with ``ast``."""
    docs: list[Document] = []
    for path in iter_stdlib_files(root):
        try:
            source = path.read_text(encoding="utf-8")
            docs.extend(_docs_from_source(_module_name(root, path), source))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # e.g. files written for another Python version
    return docs


def _normalise(text: str) -> str:
    return " ".join(text.split())


def _is_private(doc: Document) -> bool:
    return any(part.startswith("_") for part in doc.name.split("."))


def build_corpus(min_chars: int = 20) -> list[Document]:
    """All documents, deduplicated on their (whitespace-normalised) body, in sorted order.

    When the same docstring appears more than once (``open``, ``_io.open``, ``_pyio.open``) the
    copy under a public name wins.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = collect_topic_docs() + collect_compiled_docs(stdlib) + collect_stdlib_docs(stdlib)
    candidates.sort(key=_is_private)  # stable: keeps the collection order otherwise
    seen: set[str] = set()
    docs: list[Document] = []
    for doc in candidates:
        key = _normalise(doc.body)
        if len(key) < min_chars or key in seen:
            continue
        seen.add(key)
        docs.append(doc)
    docs.sort(key=lambda d: (d.kind, d.name, d.heading, d.body))
    return docs


# --------------------------------------------------------------------------------------------
# Chat samples derived from the documents
# --------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\"'])[.!?](?=\s+[A-Z\"'(]|$)")


def summarise(text: str, max_chars: int = 420, max_sentences: int = 3) -> str:
    """First sentences of the first prose paragraph of ``text`` (whitespace-collapsed)."""
    for paragraph in re.split(r"\n\s*\n", text):
        lines = paragraph.strip().splitlines()
        if not lines or lines[0].startswith((" ", ">>>", "*", "=", "-", "+", "|")):
            continue
        flat = _normalise(paragraph)
        if len(flat) < 20 or not flat[0].isalpha():
            continue
        ends = [m.end() for m in _SENTENCE_END.finditer(flat)]
        ends = [e for e in ends if e <= max_chars][:max_sentences]
        if ends:
            return flat[: ends[-1]]
        if len(flat) <= max_chars:
            return flat
    return ""


def _topic_sections(topic: Document) -> Iterator[tuple[str, str]]:
    """(title, text) for each section of a pydoc topic page (titles are underlined)."""
    lines = topic.body.splitlines()
    starts = [
        i
        for i in range(len(lines) - 1)
        if lines[i].strip()
        and re.fullmatch(r"[*=\-~^]{3,}", lines[i + 1].strip())
        and len(lines[i + 1].strip()) >= len(lines[i].strip()) - 2
    ]
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        yield lines[start].strip(), "\n".join(lines[start + 2 : end])


def _lower_first(text: str) -> str:
    if len(text) > 1 and text[1].isupper():  # acronyms: "HTTP ..."
        return text
    return text[:1].lower() + text[1:]


def _howto_question(summary_line: str) -> str | None:
    words = summary_line.rstrip(".").split()
    if len(words) < 2 or words[0].lower() not in HOWTO_VERBS or not words[0][0].isupper():
        return None
    clause = " ".join(words[:14])
    clause = re.split(r"[;:]| - ", clause)[0].rstrip(" ,.")
    return f"How do I {_lower_first(clause)}?"


def chat_samples(docs: Iterable[Document]) -> list[list[dict[str, str]]]:
    """Single-turn conversations whose answers are the opening sentences of a document."""
    conversations: list[list[dict[str, str]]] = []
    seen: set[tuple[str, str]] = set()

    def add(question: str, answer: str) -> None:
        if (question, answer) in seen:
            return
        seen.add((question, answer))
        conversations.append(
            [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        )

    for doc in docs:
        if doc.kind == "topic":
            for title, section in _topic_sections(doc):
                answer = summarise(section)
                if answer:
                    add(f"What is {_lower_first(title)}?", answer)
                    add(f"Explain {_lower_first(title)}.", answer)
            continue
        answer = summarise(doc.body)
        if not answer:
            continue
        short = doc.name.rsplit(".", 1)[-1] if doc.kind == "function" else doc.name
        if doc.kind == "module":
            add(f"What is the {doc.name} module for?", answer)
        elif doc.kind == "class":
            add(f"What is {doc.name}?", answer)
        else:
            add(f"What does {doc.name}() do?", answer)
            question = _howto_question(answer.split(". ")[0])
            if question:
                add(question, f"Use {short}(). {answer}")
    return conversations


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE whose ids 0..6 are the special tokens; encoding prepends ``<|bos|>``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    tokenizer.save(str(out / "tokenizer.json"))
    added_tokens = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    roles = [SYSTEM, USER, ASSISTANT, END]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": roles,
        "added_tokens_decoder": added_tokens,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": roles,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def encode_documents(
    tokenizer: Tokenizer, texts: list[str], chats: list[str], rng: random.Random
) -> list[int]:
    """One token stream of ``<|bos|> text <|eos|>`` items (chats are pre-rendered), shuffled."""
    eos_id = tokenizer.token_to_id(EOS)
    items = [enc.ids + [eos_id] for enc in tokenizer.encode_batch(texts)]
    # Rendered chats already start with <|bos|> (from the template): no extra special tokens.
    items += [enc.ids + [eos_id] for enc in tokenizer.encode_batch(chats, add_special_tokens=False)]
    rng.shuffle(items)
    return [token for item in items for token in item]


def chunk(stream: list[int], seq_len: int) -> torch.Tensor:
    """Split a token stream into ``[n, seq_len]`` rows (the ragged tail is dropped)."""
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def batches(data: torch.Tensor, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless iterator over batches of rows, reshuffled each epoch by a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(data.shape[0], generator=generator)
        for start in range(0, data.shape[0] - batch_size + 1, batch_size):
            yield data[order[start : start + batch_size]]


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def lr_at(progress: float, peak: float, warmup: float, floor: float) -> float:
    """Linear warmup to ``peak`` for the first ``warmup`` fraction, then cosine to ``floor``."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / max(1e-8, 1.0 - warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor, batch_size: int, bf16: bool) -> float:
    """Mean next-token cross-entropy over ``data``."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, data.shape[0], batch_size):
        rows = data[start : start + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=rows, labels=rows).loss
        tokens = rows.shape[0] * (rows.shape[1] - 1)
        total += loss.item() * tokens
        count += tokens
    model.train()
    return total / max(1, count)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("models/radixserve-demo"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=40.0, help="wall-clock budget for training")
    p.add_argument(
        "--max-steps",
        type=int,
        default=850,
        help="optimizer steps; 0 = as many as fit in --minutes (schedule follows the clock)",
    )
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=float, default=0.05, help="warmup fraction of the run")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument(
        "--eval-rows", type=int, default=0, help="validation rows per evaluation (0 = all)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast")
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    bf16 = not args.no_bf16
    started = time.time()

    # ---- corpus and split ----
    docs = build_corpus()
    order = list(range(len(docs)))
    rng.shuffle(order)
    n_val = max(1, round(len(docs) * args.val_fraction))
    val_docs = [docs[i] for i in sorted(order[:n_val])]
    train_docs = [docs[i] for i in sorted(order[n_val:])]
    train_chats, val_chats = chat_samples(train_docs), chat_samples(val_docs)
    print(
        f"corpus: {len(docs)} documents ({sum(len(d.text()) for d in docs) / 1e6:.1f}M chars), "
        f"train {len(train_docs)} + {len(train_chats)} chats, "
        f"val {len(val_docs)} + {len(val_chats)} chats",
        flush=True,
    )

    # ---- tokenizer ----
    args.out.mkdir(parents=True, exist_ok=True)
    train_texts = [d.text() for d in train_docs]
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    save_tokenizer(tokenizer, args.out, args.max_position_embeddings)
    hf_tokenizer = AutoTokenizer.from_pretrained(args.out)

    def render(conversations: list[list[dict[str, str]]]) -> list[str]:
        return [hf_tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]

    train_stream = encode_documents(tokenizer, train_texts, render(train_chats), rng)
    val_stream = encode_documents(tokenizer, [d.text() for d in val_docs], render(val_chats), rng)
    train_data = chunk(train_stream, args.seq_len)
    val_data = chunk(val_stream, args.seq_len)
    print(
        f"tokenizer: {tokenizer.get_vocab_size()} tokens; train {len(train_stream) / 1e6:.2f}M "
        f"tokens ({train_data.shape[0]} rows), val {len(val_stream) / 1e3:.0f}k tokens "
        f"({val_data.shape[0]} rows)",
        flush=True,
    )

    # ---- model ----
    special = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=special[BOS],
        eos_token_id=[special[EOS], special[END]],
        pad_token_id=special[PAD],
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters ({n_params / 1e6:.2f}M)", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    # ---- training loop ----
    budget_s = args.minutes * 60.0
    by_clock = args.max_steps <= 0
    eval_rows = val_data[: args.eval_rows] if args.eval_rows > 0 else val_data
    best_val, best_step, best_state = float("inf"), 0, None
    train_iter = batches(train_data, args.batch_size, args.seed)
    model.train()
    t0 = time.time()
    step, smooth, val_loss = 0, float("nan"), float("nan")
    bar = tqdm(total=None if by_clock else args.max_steps, desc="train", unit="step")
    while True:
        elapsed = time.time() - t0
        if not by_clock and step >= args.max_steps:
            break
        if elapsed >= budget_s:
            if not by_clock:
                tqdm.write(f"time budget reached after {step} of {args.max_steps} steps")
            break
        # Step-based schedule, unless the clock is ahead of it (a slow or busy machine): then
        # follow the clock so the learning rate still anneals before the budget runs out.
        progress = elapsed / budget_s
        if not by_clock:
            progress = max(progress, (step + 1) / args.max_steps)
        lr = lr_at(progress, args.lr, args.warmup, args.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        rows = next(train_iter)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        smooth = loss.item() if math.isnan(smooth) else 0.95 * smooth + 0.05 * loss.item()
        if step % args.eval_every == 0:
            val_loss = evaluate(model, eval_rows, args.batch_size, bf16)
            if val_loss < best_val:  # keep the best weights in case the small corpus overfits
                best_val, best_step = val_loss, step
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            tqdm.write(
                f"step {step}: train {smooth:.3f} val {val_loss:.3f} lr {lr:.2e} "
                f"({time.time() - t0:.0f}s)"
            )
        bar.set_postfix(loss=f"{smooth:.3f}", val=f"{val_loss:.3f}", lr=f"{lr:.1e}")
        bar.update(1)
    bar.close()
    train_s = time.time() - t0
    final_val = evaluate(model, val_data, args.batch_size, bf16)
    if best_state is not None and args.eval_rows <= 0 and best_val < final_val:
        print(f"restoring step {best_step} weights (val {best_val:.4f} < {final_val:.4f})")
        model.load_state_dict(best_state)
        final_val = best_val
    print(
        f"done: {step} steps, {step * args.batch_size * args.seq_len / 1e6:.2f}M tokens in "
        f"{train_s / 60:.1f} min; final val loss {final_val:.4f} "
        f"(ppl {math.exp(final_val):.1f}) over {val_data.numel() / 1e3:.0f}k tokens",
        flush=True,
    )

    # ---- save ----
    model.to(getattr(torch, args.save_dtype))
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=special[BOS],
        eos_token_id=[special[EOS], special[END]],
        pad_token_id=special[PAD],
        max_new_tokens=128,
    )
    model.save_pretrained(args.out, safe_serialization=True)
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"saved to {args.out} ({size / 1e6:.1f} MB)", flush=True)

    # ---- greedy samples from the saved checkpoint ----
    model = AutoModelForCausalLM.from_pretrained(args.out)
    hf_tokenizer = AutoTokenizer.from_pretrained(args.out)
    chat = [{"role": "user", "content": "How do I open a file?"}]
    prompts = {
        "chat: How do I open a file?": hf_tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )["input_ids"],
        "text: The open() function": hf_tokenizer("The open() function", return_tensors="pt")[
            "input_ids"
        ],
    }
    for label, ids in prompts.items():
        out = model.generate(ids, max_new_tokens=64, do_sample=False)
        text = hf_tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        print(f"--- {label}\n{text}\n", flush=True)
    print(f"total wall time {(time.time() - started) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    sys.exit(main())
