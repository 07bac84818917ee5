"""Tools through the real stack and the `openai` client: the request's tools and a conversation's
tool calls and tool results reach the chat template (arguments as objects, as templates expect),
and a tools request with auto tool choice is served (the built-in model writes no calls, so its
text comes back as content)."""

import json

from tests.e2e.conftest import MODEL, encode

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
# A template that shows what reached it: the tool names, each call's city (an object access, so the
# JSON-string arguments must have been parsed) and id, and each tool result with the id it answers.
TEMPLATE = ("{% for tool in tools or [] %}[tool {{ tool.function.name }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% for call in m.tool_calls or [] %}[call {{ call.id }} {{ call.function.name }} "
            "{{ call.function.arguments.city }}]{% endfor %}"
            "{% if m.tool_call_id %}[answers {{ m.tool_call_id }}]{% endif %}{% endfor %}")
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
    {"role": "tool", "tool_call_id": "call_7", "content": "sunny"},
]
RENDERED = ("[tool get_weather]<user>Weather in Paris?<assistant>[call call_7 get_weather Paris]"
            "<tool>sunny[answers call_7]")


def test_tools_and_tool_turns_reach_the_template(client, tokenizer):
    response = client.chat.completions.create(
        model=MODEL, messages=CONVERSATION, tools=[WEATHER], tool_choice="none", max_tokens=2,
        extra_body={"chat_template": TEMPLATE, "add_generation_prompt": False})
    assert response.usage.prompt_tokens == len(encode(tokenizer, RENDERED))


def test_auto_tool_choice_serves_text_as_content(client):
    for stream in (False, True):
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
            max_tokens=8, temperature=0, stream=stream)
        if stream:
            chunks = list(response)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason == "length"
        else:
            content = response.choices[0].message.content
            assert not response.choices[0].message.tool_calls
            assert response.choices[0].finish_reason == "length"
        assert content
