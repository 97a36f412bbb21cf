"""The xgrammar backend (PyPI ``xgrammar``): grammars compiled to token-level automata.

xgrammar compiles JSON schemas, regexes, EBNF (its GBNF dialect) and structural tags against the
tokenizer's vocabulary once; a ``GrammarMatcher`` then fills a token bitmask per step in
microseconds and advances by accepted tokens. Compilation runs in C++ without the GIL.

Two corrections to what xgrammar 0.2.8 produces for JSON schemas:

- keywords it would not enforce are refused before compiling (``schema_support.py``);
- the characters of JSON strings are narrowed: with ``minLength``/``maxLength`` xgrammar's class
  admits raw control characters (U+0000-U+001F), which JSON forbids inside strings
  (mlc-ai/xgrammar#800), and every string class admits the surrogate code points
  U+D800-U+DFFF, whose UTF-8 bytes are invalid UTF-8 (they decode to three U+FFFD each, so the
  text breaks ``maxLength`` too). Both string classes are replaced by JSON's unescaped
  characters minus the surrogates; if xgrammar changes its classes, the replacement finds
  nothing and the grammar is used as xgrammar made it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch
import xgrammar as xgr

from radixserve.constrained.base import GrammarBackend, GrammarError, GrammarKey, GrammarMatcher
from radixserve.constrained.regex_support import check_regex
from radixserve.constrained.schema_support import check_json_schema

# The character classes of JSON strings in xgrammar's EBNF, length-bounded and not (see the
# module docstring), and what replaces them: JSON's unescaped characters minus the surrogates.
_STRING_CHAR_CLASSES = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\uD800-\uDFFF]'
# xgrammar's C++ errors start with a timestamp, a source location and sometimes a failed check.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


@dataclass(frozen=True)
class JsonWhitespace:
    """The whitespace JSON-schema output may put between tokens (xgrammar's options of
    ``Grammar.from_json_schema``, under its names): any whitespace unless ``any_whitespace`` is
    False (then the compact separators ``", "`` and ``": "``); ``max_whitespace_cnt`` bounds
    each run of whitespace, so that a model cannot loop on whitespace until its length limit.
    """

    any_whitespace: bool = True
    max_whitespace_cnt: int | None = None


class XGrammarBackend(GrammarBackend):
    """xgrammar over a Hugging Face tokenizer.

    ``stop_token_ids`` (the model's EOS ids) end every grammar; ``json_whitespace`` is what
    JSON-schema output may put between tokens.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 json_whitespace: JsonWhitespace) -> None:
        self.vocab_size = vocab_size
        self.json_whitespace = json_whitespace
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # radixserve's GrammarCache caches compiled grammars; xgrammar's own cache would keep a
        # second copy. One compile thread: requests are compiled one after another.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        try:
            if key.kind == "json_schema":
                compiled = self._compile_json_schema(key.spec)
            elif key.kind == "regex":
                check_regex(key.spec, "regex")
                compiled = self._compiler.compile_regex(key.spec)
            elif key.kind == "ebnf":
                compiled = self._compiler.compile_grammar(key.spec)
            elif key.kind == "structural_tag":
                compiled = self._compile_structural_tag(key.spec)
            else:
                raise GrammarError(f"unknown grammar kind {key.kind!r}")
        except RuntimeError as e:  # xgrammar reports every invalid grammar this way
            raise GrammarError(f"invalid {key.kind}: {_clean(e)}") from None
        self._check_admits_output(key, compiled)
        return compiled

    def _check_admits_output(self, key: GrammarKey, compiled: xgr.CompiledGrammar) -> None:
        """Refuse a grammar that admits no first token, not even the end (``root ::= root "a"``;
        ``{"$ref": "#"}`` before xgrammar 0.2.9, which refuses it itself): decoding under it could
        only produce text outside it."""
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()) and not matcher.is_terminated():
            raise GrammarError(f"invalid {key.kind}: it admits no output at all (no string "
                               "matches it, not even an empty one)")

    def _compile_json_schema(self, spec: str) -> xgr.CompiledGrammar:
        schema = _parse_json(spec, "json_schema")
        check_json_schema(schema)
        grammar = xgr.Grammar.from_json_schema(spec, **asdict(self.json_whitespace))
        ebnf = str(grammar)
        for char_class in _STRING_CHAR_CLASSES:
            ebnf = ebnf.replace(char_class, _JSON_STRING_CHAR)
        return self._compiler.compile_grammar(ebnf)

    def _compile_structural_tag(self, spec: str) -> xgr.CompiledGrammar:
        tag = _parse_json(spec, "structural_tag")
        if not isinstance(tag, dict):
            raise GrammarError("invalid structural_tag: it must be a JSON object")
        if "structures" in tag:
            tag = _from_legacy_structural_tag(tag)
        for schema in _tagged(tag, "json_schema", "json_schema"):
            check_json_schema(schema)
        for pattern in _tagged(tag, "regex", "pattern"):
            check_regex(pattern, "structural_tag regex")
        return self._compiler.compile_structural_tag(json.dumps(tag))

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    @staticmethod
    def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def _parse_json(spec: str, kind: str) -> Any:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid {kind}: not valid JSON ({e})") from None


def _clean(error: RuntimeError) -> str:
    """xgrammar's message without its C++ timestamp, source location and check text."""
    return _CPP_PREFIX.sub("", str(error).strip())


def _from_legacy_structural_tag(tag: dict[str, Any]) -> dict[str, Any]:
    """SGLang's original structural tag (``structures`` of begin/schema/end plus ``triggers``)
    in xgrammar's current format: the same tags, triggered by the same prefixes."""
    try:
        tags = [
            {
                "type": "tag",
                "begin": s["begin"],
                "content": {"type": "json_schema", "json_schema": s.get("schema") or {}},
                "end": s["end"],
            }
            for s in tag["structures"]
        ]
        triggers = list(tag["triggers"])
    except (KeyError, TypeError) as e:
        raise GrammarError(
            "invalid structural_tag: 'structures' must be a list of {begin, schema, end} and "
            f"'triggers' a list of strings ({e!r} is missing or wrong)"
        ) from None
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": triggers,
            "tags": tags,
            "at_least_one": bool(tag.get("at_least_one", False)),
            "stop_after_first": False,
        },
    }


def _tagged(node: Any, kind: str, field: str) -> list[Any]:
    """The ``field`` of every ``{"type": kind}`` format inside a structural tag (its JSON
    schemas, its regexes' patterns)."""
    if isinstance(node, list):
        return [s for item in node for s in _tagged(item, kind, field)]
    if not isinstance(node, dict):
        return []
    found = [node[field]] if node.get("type") == kind and field in node else []
    return found + [s for value in node.values() for s in _tagged(value, kind, field)]
