"""Chat templates of the test checkpoints that render tools, one per tool-call format.

Written for these tests in the manner of the real models' templates: the tools go into the
prompt, an assistant message's ``tool_calls`` are written back in the model's own call format
(arguments arrive as objects and are written with ``tojson``), and tool results get their own
turn. The test tokenizer's control tokens (``<|user|>``, ...) stand in for each family's.
"""

from __future__ import annotations

# Qwen3-style: Hermes <tool_call> blocks, <tool_response> turns, <think> and enable_thinking.
HERMES_THINKING = (
    "{%- if tools %}<|system|>{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call a function with <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call>"
    "<|eos|>"
    "{%- elif messages[0].role == 'system' %}<|system|>{{ messages[0].content }}<|eos|>"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|user|>{{ m.content }}<|eos|>"
    "{%- elif m.role == 'assistant' %}<|assistant|>"
    "{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{- m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|eos|>"
    "{%- elif m.role == 'tool' %}<|user|><tool_response>\n{{ m.content }}\n</tool_response>"
    "<|eos|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)

# Llama 3.1-style JSON calls: {"name", "parameters"}, <|python_tag|>, results in a tool turn.
LLAMA3_JSON = (
    "<|bos|>"
    "{%- if tools %}<|system|>Answer with a JSON function call {\"name\": function name, "
    "\"parameters\": its arguments}, or in words.\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eos|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.tool_calls %}<|assistant|><|python_tag|>"
    "{%- for c in m.tool_calls %}{% if not loop.first %}; {% endif %}"
    "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}"
    "{%- endfor %}<|eos|>"
    "{%- elif m.role == 'tool' %}<|tool|>{{ m.content }}<|eos|>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}<|eos|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Mistral-style: [AVAILABLE_TOOLS], [TOOL_CALLS] arrays, [TOOL_RESULTS]; like Mistral's own
# templates it refuses tool-call ids that are not 9 alphanumeric characters.
MISTRAL = (
    "<|bos|>"
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{%- endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}"
    "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{%- endif %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{%- if c.id | length != 9 or not c.id.isalnum() %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{% if not loop.first %}, {% endif %}{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}, \"id\": \"{{ c.id }}\"}"
    "{%- endfor %}]<|eos|>"
    "{%- elif m.role == 'assistant' %}{{ m.content }}<|eos|>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{\"content\": {{ m.content | tojson }}, "
    "\"call_id\": \"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{%- else %}{{ m.content }}\n\n{% endif %}"
    "{%- endfor %}"
)
