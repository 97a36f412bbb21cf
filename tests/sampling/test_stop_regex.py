"""stop_regex: RE2 patterns, refused with a message naming the field when RE2 cannot run them,
searched in a window of bounded size whose left edge is context, not output start."""

from __future__ import annotations

import pytest

from radixserve.sampling import SamplingParams
from radixserve.sampling.stop_regex import (
    MAX_STOP_REGEX_CHARS,
    MAX_WINDOW_TOKENS,
    find_stop_regex,
    match_start,
    window_tokens,
)


@pytest.mark.parametrize("pattern", [r"(a)\1", "(?=a)", "(?<=a)b", "a{100000}", "(("])
def test_patterns_re2_cannot_run_are_refused_naming_stop_regex(pattern):
    with pytest.raises(ValueError, match="stop_regex"):
        SamplingParams.from_dict({"stop_regex": pattern})


def test_an_over_long_pattern_is_refused():
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_REGEX_CHARS} characters"):
        SamplingParams.from_dict({"stop_regex": "a" * (MAX_STOP_REGEX_CHARS + 1)})


def test_a_backtracking_pattern_is_accepted_and_searched_in_linear_time():
    """Python's re would take ~fib(10_000) steps here; RE2 answers at once (no match)."""
    params = SamplingParams.from_dict({"stop_regex": "(a|aa)+$b"})
    assert find_stop_regex(params.stop_regex, "a" * 10_000, at_start=True) is None
    assert match_start("(a|aa)+$b", "a" * 10_000) == -1


def test_the_window_is_short_for_bounded_patterns_and_capped_for_unbounded_ones():
    assert window_tokens(["abc"]) == 13  # four tokens per character, +1
    assert window_tokens(["ab", "x{10}"]) == 41
    assert window_tokens(["a+"]) == MAX_WINDOW_TOKENS
    assert window_tokens(["a{2000}"]) == MAX_WINDOW_TOKENS
    assert window_tokens([r"\pL"]) == MAX_WINDOW_TOKENS  # RE2 syntax Python cannot measure


def test_anchors_see_the_window_edge_as_context():
    assert find_stop_regex(["^ab"], "abc", at_start=True) == "^ab"
    assert find_stop_regex(["^ab"], "xabc", at_start=False) is None  # not the output's start
    assert find_stop_regex([r"\bab"], " abc", at_start=False) == r"\bab"
    assert find_stop_regex([r"\bab"], "xabc", at_start=False) is None
    assert find_stop_regex(["c$", "b"], "abc", at_start=True) == "c$"


def test_match_start_counts_characters_not_bytes():
    assert match_start("é+b", "ààéébx") == 2
