"""Reasoning parsers on fixed texts: qwen3 (the model or the prompt opens ``<think>``),
deepseek-r1 (the output starts in the block), and streams that add up to the final parse."""

from __future__ import annotations

import random

import pytest

from radixserve.server.openai.reasoning import create_reasoning_parser

PROMPT = "<|im_start|>assistant\n"
OPENED = "<|im_start|>assistant\n<think>\n"
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"

# (parser, prompt, text, reasoning, content)
CASES = [
    ("qwen3", PROMPT, "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.", "Let me see: 2+2.",
     "It is 4."),
    ("qwen3", PROMPT, "It is 4.", None, "It is 4."),
    ("qwen3", CLOSED, "It is 4, <think> is a tag.", None, "It is 4, <think> is a tag."),
    ("qwen3", OPENED, "Hmm.\n</think>\n\nFour.", "Hmm.", "Four."),
    ("qwen3", PROMPT, "<think>\nStill thinking when cut", "Still thinking when cut", ""),
    ("qwen3", PROMPT, "<think></think>Four.", None, "Four."),
    ("qwen3", PROMPT, "<thinking>x</thinking>", None, "<thinking>x</thinking>"),
    ("deepseek-r1", OPENED, "Hmm.</think>Four.", "Hmm.", "Four."),
    ("deepseek-r1", PROMPT, "<think>Hmm.</think>\nFour.", "Hmm.", "Four."),
    ("deepseek-r1", PROMPT, "No closing tag at all", "No closing tag at all", ""),
    ("qwen3", PROMPT, '<think>a < b </think>\n<tool_call>{"x": 1}</tool_call>', "a < b",
     '<tool_call>{"x": 1}</tool_call>'),
]


def stream(parser, pieces):
    reasoning = content = ""
    for k, piece in enumerate(pieces):
        r, c = parser.parse_streaming(piece, k == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content


@pytest.mark.parametrize(("name", "prompt", "text", "reasoning", "content"), CASES)
def test_final_parse(name, prompt, text, reasoning, content):
    assert create_reasoning_parser(name, prompt).parse_final(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "prompt", "text", "reasoning", "content"), CASES)
def test_streams_add_up_to_the_final_parse(name, prompt, text, reasoning, content):
    rng = random.Random(0)
    splits = [list(text), [text]]
    for _ in range(20):
        points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        splits.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)],
                                                  strict=True)])
    for pieces in splits:
        assert stream(create_reasoning_parser(name, prompt), pieces) == (reasoning, content)


def test_a_stream_sends_reasoning_before_the_block_closes():
    parser = create_reasoning_parser("qwen3", PROMPT)
    assert parser.parse_streaming("<think>\nFirst ", False) == ("First", "")
    assert parser.parse_streaming("step</thi", False) == (" step", "")
    assert parser.parse_streaming("nk>\n\nAnswer", True) == ("", "Answer")


def test_under_a_grammar_only_a_block_the_output_opens_is_reasoning():
    """deepseek-r1's template opens the block, but JSON a grammar allowed is not reasoning."""
    for name in ("deepseek-r1", "qwen3"):
        parser = create_reasoning_parser(name, OPENED, constrained=True)
        assert parser.parse_final('{"a": 1}') == (None, '{"a": 1}')
        assert parser.parse_final("<think>x</think>{}") == ("x", "{}")
    assert create_reasoning_parser("deepseek-r1", OPENED).parse_final("{}") == ("{}", "")


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        create_reasoning_parser("o1", PROMPT)
