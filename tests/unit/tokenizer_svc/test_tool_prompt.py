"""Tools in chat prompts: a template that reads ``tools`` renders them as transformers
does; one that does not (SmolLM2's) gets the default Hermes-style section, and the
assistant's calls and the tool results in the transcript."""

from __future__ import annotations

import json
from typing import Any

from llm.v1 import common_pb2, tokenizer_pb2
from tokenizer_svc.chat_template import ChatTemplate
from tokenizer_svc.service import encode_request, request_chars
from tokenizer_svc.tokenizer import TextTokenizer
from tokenizer_svc.tool_prompt import chat_input, tools_section

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = common_pb2.Tool(
    type="function",
    function=common_pb2.FunctionDefinition(
        name="weather", description="Weather of a city", parameters=json.dumps(PARAMS)
    ),
)
MESSAGES = [
    common_pb2.ChatMessage(role="system", content="Be brief."),
    common_pb2.ChatMessage(role="user", content="Weather in Paris?"),
    common_pb2.ChatMessage(
        role="assistant",
        tool_calls=[
            common_pb2.ToolCall(
                id="call_1", type="function", name="weather", arguments='{"city": "Paris"}'
            )
        ],
    ),
    common_pb2.ChatMessage(role="tool", tool_call_id="call_1", content='{"celsius": 21}'),
]
# a small template of our own that reads tools and calls the way tools-aware ones do
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }}={{ t.function.parameters"
    " | tojson }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments.city }}]{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def request() -> tokenizer_pb2.EncodeRequest:
    return tokenizer_pb2.EncodeRequest(
        messages=common_pb2.ChatMessages(messages=MESSAGES), tools=[TOOL]
    )


def test_a_template_without_tools_gets_the_default_prompt(tok: TextTokenizer) -> None:
    assert tok.chat_template is not None
    assert not tok.chat_template.supports_tools
    ids, text = encode_request(tok, request())
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert tools_section([TOOL]) in text
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"celsius": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == tok.encode(text, add_special_tokens=False)
    plain = tokenizer_pb2.EncodeRequest(messages=common_pb2.ChatMessages(messages=MESSAGES[:2]))
    plain_ids, _ = encode_request(tok, plain)
    assert len(ids) > len(plain_ids) + 50  # the tools count as prompt tokens
    assert request_chars(request()) > request_chars(plain) + len(TOOL.function.parameters)


def test_without_a_system_message_the_section_is_one() -> None:
    msgs, tools = chat_input(ChatTemplate("{{ messages }}", {}), MESSAGES[1:2], [TOOL])
    assert tools is None
    assert msgs[0].role == "system"
    assert msgs[0].content == tools_section([TOOL])


def test_a_tools_template_renders_like_transformers(hf_tok: Any) -> None:
    template = ChatTemplate(TOOLS_TEMPLATE, {})
    assert template.supports_tools
    msgs, tools = chat_input(template, MESSAGES, [TOOL])
    ours = template.render(msgs, True, tools)
    hf_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    hf_tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Weather of a city",
                "parameters": PARAMS,
            },
        }
    ]
    theirs = hf_tok.apply_chat_template(
        hf_messages,
        tools=hf_tools,
        chat_template=TOOLS_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ours == theirs
    assert "TOOLS:weather=" in ours
    assert "[call_1 weather Paris]" in ours
