"""``--reasoning-parser``: a thinking model's ``<think>...</think>`` apart from its answer.

Both supported families write their reasoning between ``<think>`` and ``</think>``, then the
answer. They differ in who opens the block:

- ``qwen3``: the model writes ``<think>`` itself, unless the chat template already ended the
  prompt with it (Qwen3's thinking-only models do): the parser looks at the rendered prompt.
  With ``enable_thinking: false`` the template writes an empty block into the prompt, so the
  output is all answer;
- ``deepseek-r1``: the template opens the block, so the output starts as reasoning (a ``<think>``
  the model writes anyway is dropped); a text without ``</think>`` is reasoning through and
  through.

Reasoning and content are stripped of the whitespace around them. A stream sends reasoning and
content as they arrive, holding back only what may be the start of a tag or trailing whitespace,
so that the pieces add up to the final parse.
"""

from __future__ import annotations

from radixserve.server.openai.tool_parsers.json_scan import held_marker_prefix

THINK_START, THINK_END = "<think>", "</think>"

# name → whether the output starts inside the reasoning block whatever the prompt says.
REASONING_PARSERS = {"qwen3": False, "deepseek-r1": True}


class ReasoningParser:
    """Splits one choice's text; ``parse_streaming`` keeps the state of its stream."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self._text = ""
        self._reasoning_sent = 0
        self._content_sent = 0

    def scan(self, text: str, final: bool) -> tuple[str | None, str]:
        """``(reasoning, content)`` of ``text``; reasoning is None when there is no block."""
        stripped = text.lstrip()
        if not final and THINK_START.startswith(stripped) and stripped != THINK_START:
            return ("" if self.starts_in_reasoning else None), ""  # "<think>" may be coming
        if stripped.startswith(THINK_START):
            start = len(text) - len(stripped) + len(THINK_START)
        elif self.starts_in_reasoning:
            start = 0
        else:
            return None, text
        end = text.find(THINK_END, start)
        if end < 0:
            reasoning = text[start:].lstrip()
            if not final:
                reasoning = reasoning[:len(reasoning) - held_marker_prefix(reasoning,
                                                                           (THINK_END,))]
            return reasoning.rstrip(), ""
        return text[start:end].strip(), text[end + len(THINK_END):].lstrip()

    def parse_final(self, text: str) -> tuple[str | None, str]:
        reasoning, content = self.scan(text, final=True)
        return reasoning or None, content

    def parse_streaming(self, new_text: str, done: bool) -> tuple[str, str]:
        """The reasoning and the content that ``new_text`` adds (``done`` on the last piece)."""
        self._text += new_text
        reasoning, content = self.scan(self._text, final=done)
        reasoning = reasoning or ""
        delta = reasoning[self._reasoning_sent:], content[self._content_sent:]
        self._reasoning_sent = max(self._reasoning_sent, len(reasoning))
        self._content_sent = max(self._content_sent, len(content))
        return delta


def create_reasoning_parser(name: str, prompt_text: str, constrained: bool = False
                            ) -> ReasoningParser:
    """The parser of one choice whose prompt rendered to ``prompt_text``.

    Under a grammar (``constrained``: a response format, an enforced tool choice, ...) the
    output is what the grammar allows from its first token, not the rest of a block the prompt
    opened: only a block the output itself opens with ``<think>`` is reasoning.
    """
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}"
        )
    opened = prompt_text.rstrip().endswith(THINK_START)
    return ReasoningParser(not constrained and (REASONING_PARSERS[name] or opened))
