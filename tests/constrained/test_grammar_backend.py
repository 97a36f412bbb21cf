"""The grammar layer's contract (constrained/base.py), checked on the xgrammar backend and the
test tokenizer: compile errors users see, what is refused, matcher and bitmask semantics."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch
from transformers import AutoTokenizer

from radixserve.constrained import GrammarCache, GrammarError, GrammarKey, create_grammar_backend
from radixserve.constrained.limits import (
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_STEP_BUDGET_S,
    compile_timeout_s,
    step_budget_s,
)
from radixserve.server.openai.tool_parsers.enforced import required_schema

EOS = 1


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    return AutoTokenizer.from_pretrained(llama_path)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return create_grammar_backend(tokenizer, len(tokenizer), [EOS])


def walk(backend, matcher, tokenizer, text: str) -> bool:
    """Feed ``text`` token by token, checking each token against the filled bitmask."""
    bitmask = backend.allocate_bitmask(1)
    for token in tokenizer.encode(text):
        matcher.fill_bitmask(bitmask, 0)
        allowed = bool((bitmask[0, token // 32] >> (token % 32)) & 1)
        accepted = matcher.accept_token(token)
        assert allowed == accepted, f"bitmask and accept_token disagree on {token}"
        if not accepted:
            return False
    return True


@pytest.mark.parametrize(
    ("kind", "spec", "good", "bad"),
    [
        ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"]}), '{"a": 12}', '{"b": 1}'),
        ("regex", r"[0-9]{2,6}", "2024", "20a"),
        ("ebnf", 'root ::= "yes" | "no"', "yes", "yep"),
        ("structural_tag", json.dumps({
            "type": "structural_tag",
            "format": {"type": "tag", "begin": "<x>", "end": "</x>",
                       "content": {"type": "json_schema", "json_schema": {"type": "integer"}}},
        }), "<x>42</x>", "<x>a</x>"),
    ],
)
def test_each_kind_compiles_and_matches_only_what_it_describes(backend, tokenizer, kind, spec,
                                                               good, bad):
    compiled = backend.compile(GrammarKey(kind, spec))
    matcher = backend.new_matcher(compiled)
    assert walk(backend, matcher, tokenizer, good)
    assert not matcher.is_terminated()
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    assert not walk(backend, backend.new_matcher(compiled), tokenizer, bad)


def test_legacy_structural_tag_is_translated(backend, tokenizer):
    legacy = {"type": "structural_tag", "triggers": ["<f"],
              "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}]}
    matcher = backend.new_matcher(backend.compile(GrammarKey("structural_tag", json.dumps(legacy))))
    assert walk(backend, matcher, tokenizer, "hello <f>7</f>")
    assert not walk(backend, backend.new_matcher(
        backend.compile(GrammarKey("structural_tag", json.dumps(legacy)))), tokenizer, "<f>x")


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", "{not json", "invalid json_schema: not valid JSON"),
        ("json_schema", '{"type": "objec"}', 'invalid json_schema: Unsupported type "objec"'),
        ("json_schema", "[1, 2]", "must be an object or a boolean"),
        ("regex", "[a-", "invalid regex: Regex parsing error at position 4: Unclosed '['"),
        ("ebnf", 'root ::= "a" | b', 'invalid ebnf: EBNF parser error at line 1, column 16: '
                                     'Rule "b" is not defined'),
        ("structural_tag", '{"type": "structural_tag", "format": {"type": "bogus"}}',
         "Format type not recognized: bogus"),
        ("structural_tag", '{"structures": 3, "triggers": []}', "'structures' must be a list"),
    ],
)
def test_invalid_grammars_raise_the_library_message_without_cpp_noise(backend, kind, spec,
                                                                       message):
    with pytest.raises(GrammarError) as err:
        backend.compile(GrammarKey(kind, spec))
    assert message in str(err.value)
    assert ".cc:" not in str(err.value) and "Check failed" not in str(err.value)


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"not": {"type": "integer"}}, "'not'"),
        ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
        ({"type": "array", "contains": {"const": 1}}, "'contains'"),
        ({"if": {"type": "integer"}, "then": {"minimum": 1}}, "'if'"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "'allOf' with more than one"),
        ({"type": "number", "multipleOf": 0.5}, "'multipleOf'"),
        ({"type": "string", "format": "color"}, "string format 'color'"),
        ({"type": "string", "pattern": "a+", "maxLength": 3}, "'pattern' together with"),
        ({"type": "object", "properties": {"x": {"type": "array", "items": {"not": {}}}}},
         "#/properties/x/items"),
    ],
)
def test_schemas_with_constraints_xgrammar_would_ignore_are_refused(backend, schema, named):
    with pytest.raises(GrammarError, match="cannot enforce") as err:
        backend.compile(GrammarKey("json_schema", json.dumps(schema)))
    assert named in str(err.value)


def test_enforced_neighbours_of_refused_keywords_still_compile(backend):
    for schema in ({"type": "integer", "multipleOf": 3}, {"allOf": [{"type": "integer"}]},
                   {"oneOf": [{"type": "integer"}, {"type": "string"}]},
                   {"type": "string", "format": "date"}, {"type": "array", "uniqueItems": False}):
        backend.compile(GrammarKey("json_schema", json.dumps(schema)))


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"anyOf": []}, "'anyOf' is an empty list"),
        ({"oneOf": []}, "'oneOf' is an empty list"),
        ({"type": []}, "'type' is an empty list"),
        ({"type": "object", "required": ["a"], "additionalProperties": False},
         "property 'a' is required"),
        ({"type": "object", "properties": {"o": {"type": "object", "properties": {},
                                                 "required": ["z"],
                                                 "additionalProperties": False}}},
         "#/properties/o: property 'z'"),
    ],
)
def test_schemas_no_value_can_match_are_refused(backend, schema, named):
    with pytest.raises(GrammarError, match="no value matches it") as err:
        backend.compile(GrammarKey("json_schema", json.dumps(schema)))
    assert named in str(err.value)


NESTED_EMPTY_REPEAT = "(([a-z]{0,30}){0,29}){0,31}"  # a second per token by its tenth (0.2.x)


@pytest.mark.parametrize(
    ("kind", "spec", "where"),
    [
        ("regex", NESTED_EMPTY_REPEAT, "regex: the repetition {0,31}"),
        ("regex", "([a-z]{0,2}){0,2000}", "regex: the repetition {0,2000}"),
        ("regex", "((a{0,3}){0,3}){0,3}", "regex: the repetition {0,3}"),
        ("json_schema", json.dumps({"type": "string", "pattern": NESTED_EMPTY_REPEAT}),
         "JSON schema at #: 'pattern': the repetition"),
        ("structural_tag", json.dumps({"type": "structural_tag", "format": {
            "type": "tag", "begin": "<r>", "end": "</r>",
            "content": {"type": "regex", "pattern": NESTED_EMPTY_REPEAT}}}),
         "structural_tag regex: the repetition"),
    ],
)
def test_bounded_repeats_of_what_can_be_empty_are_refused_before_compiling(backend, kind, spec,
                                                                            where):
    with pytest.raises(GrammarError, match="can match the empty string") as err:
        backend.compile(GrammarKey(kind, spec))
    assert str(err.value).startswith(where)


@pytest.mark.parametrize("regex", [
    "([a-z]{1,30}){1,29}", r"(\d{1,3}\.){3}\d{1,3}", "([a-z]*)*", "(a?){2,}", "(x|){3}",
    "[a-z]{0,1000}", "(?<name>a)",  # the last is not Python's syntax: left to xgrammar
])
def test_repeats_that_stay_fast_still_compile(backend, regex):
    backend.compile(GrammarKey("regex", regex))


def test_required_tool_calls_of_a_recursive_function_follow_its_schema(backend, tokenizer):
    """``tool_choice: "required"`` nests the parameters in an array; their ``$ref: "#"`` must
    still mean the parameters (it meant the array, and the array's items were admitted)."""
    tree = {"type": "object", "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["child"], "additionalProperties": False}
    spec = json.dumps(required_schema([{"name": "f", "parameters": tree}], parallel=True))
    compiled = backend.compile(GrammarKey("json_schema", spec))

    def call(arguments):
        return json.dumps([{"name": "f", "parameters": arguments}])

    assert walk(backend, backend.new_matcher(compiled), tokenizer, call({"child": {"child": None}}))
    assert not walk(backend, backend.new_matcher(compiled), tokenizer,
                    call({"child": [{"name": "f", "parameters": {"child": None}}]}))


def test_length_bounded_strings_reject_raw_control_characters(backend, tokenizer):
    """xgrammar 0.2.8 lets U+0000-U+001F into strings with minLength/maxLength (invalid JSON);
    the backend narrows that character class."""
    schema = json.dumps({"type": "string", "maxLength": 5})
    compiled = backend.compile(GrammarKey("json_schema", schema))
    assert walk(backend, backend.new_matcher(compiled), tokenizer, '"ab c"')
    assert not walk(backend, backend.new_matcher(compiled), tokenizer, '"a\tb"')
    assert not walk(backend, backend.new_matcher(compiled), tokenizer, '"abcdef"')


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 4}])
def test_json_strings_admit_no_surrogate_code_points(backend, tokenizer, schema):
    """Bytes ED B7 B2 encode the surrogate U+DDF2: invalid UTF-8, which xgrammar 0.2.8 lets
    into JSON strings; the backend excludes U+D800-U+DFFF."""
    compiled = backend.compile(GrammarKey("json_schema", json.dumps(schema)))
    matcher = backend.new_matcher(compiled)
    surrogate = [tokenizer.convert_tokens_to_ids(t) for t in ('"', "í", "·", "²")]
    assert [matcher.accept_token(t) for t in surrogate] == [True, True, False, False]
    assert walk(backend, backend.new_matcher(compiled), tokenizer, '"한"')


def test_rejected_token_leaves_the_matcher_where_it_was(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(GrammarKey("regex", "ab")))
    a, b, z = (tokenizer.convert_tokens_to_ids(c) for c in "abz")
    assert matcher.accept_token(a)
    assert not matcher.accept_token(z)
    assert matcher.accept_token(b) and matcher.accept_token(EOS) and matcher.is_terminated()


def test_complete_grammar_allows_only_the_stop_token(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(GrammarKey("regex", "a")))
    assert matcher.accept_token(tokenizer.convert_tokens_to_ids("a"))
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, backend.vocab_size)
    backend.apply_bitmask(logits, bitmask, [0])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]


def test_apply_bitmask_touches_only_the_listed_rows(backend):
    bitmask = backend.allocate_bitmask(3)
    bitmask[:] = 0
    bitmask[:, 0] = 0b100  # only token 2 allowed
    logits = torch.randn(3, backend.vocab_size)
    before = logits.clone()
    backend.apply_bitmask(logits, bitmask, [1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [2]
    assert logits[1, 2] == before[1, 2]


# ---------------------------------------------------------------------------- GrammarCache
class CountingBackend:
    """Wraps the real backend, counting compilations and the thread they ran on."""

    def __init__(self, inner):
        self.inner = inner
        self.compiled: list[GrammarKey] = []
        self.threads: set[str] = set()

    def compile(self, key):
        self.compiled.append(key)
        self.threads.add(threading.current_thread().name)
        return self.inner.compile(key)

    def new_matcher(self, compiled):
        return self.inner.new_matcher(compiled)


def test_cache_compiles_each_key_once_off_the_calling_thread(backend):
    counting = CountingBackend(backend)
    factory_calls = []
    cache = GrammarCache(lambda: factory_calls.append(1) or counting, max_entries=8)
    key = GrammarKey("regex", "[a-c]+")
    first, second = cache.get(key), cache.get(key)
    assert first is second
    assert first.result() is second.result()
    assert counting.compiled == [key] and factory_calls == [1]
    assert threading.current_thread().name not in counting.threads
    assert (cache.hits, cache.misses) == (1, 1)


def test_cache_keeps_failures_and_evicts_least_recently_used(backend):
    counting = CountingBackend(backend)
    cache = GrammarCache(lambda: counting, max_entries=2)
    bad = GrammarKey("regex", "(")
    with pytest.raises(GrammarError):
        cache.get(bad).result()
    with pytest.raises(GrammarError):
        cache.get(bad).result()
    assert counting.compiled == [bad]
    keys = [GrammarKey("regex", r) for r in ("a", "b", "c")]
    for key in keys:
        cache.get(key).result()
    assert len(cache) == 2
    cache.get(keys[0]).result()  # evicted: compiled again
    assert counting.compiled.count(keys[0]) == 2
    cache.clear()
    assert len(cache) == 0


def test_the_grammar_limits_are_read_once_and_off_across_ranks(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_GRAMMAR_TIMEOUT", raising=False)
    assert compile_timeout_s(distributed=False) == DEFAULT_COMPILE_TIMEOUT_S == 300  # SGLang's
    assert compile_timeout_s(distributed=True) == math.inf
    monkeypatch.delenv("RADIXSERVE_GRAMMAR_STEP_BUDGET", raising=False)
    assert step_budget_s(distributed=False) == DEFAULT_STEP_BUDGET_S
    assert step_budget_s(distributed=True) == math.inf  # ranks would time matchers apart
    monkeypatch.setenv("RADIXSERVE_GRAMMAR_STEP_BUDGET", "0.25")
    assert step_budget_s(distributed=False) == 0.25
    with pytest.raises(ValueError, match="does not combine with tensor or pipeline"):
        step_budget_s(distributed=True)
    for bad in ("-1", "nan", "soon"):
        monkeypatch.setenv("RADIXSERVE_GRAMMAR_STEP_BUDGET", bad)
        with pytest.raises(ValueError, match="seconds >= 0"):
            step_budget_s(distributed=False)
