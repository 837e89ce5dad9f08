"""The official `openai` Python client against a Duplex router, unmodified.

Run by the end-to-end test `openai_python_client_works_unmodified` (tests/serving.rs)
when the `openai` package is installed; argv[1] is the router's base URL.
"""
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)

models = client.models.list()
assert models.data[0].id == "tiny-dsv3", models

c = client.completions.create(model="tiny-dsv3", prompt="Hello", max_tokens=5, seed=1, logprobs=2, extra_body={"ignore_eos": True})
assert c.object == "text_completion" and c.choices[0].finish_reason == "length", c
assert c.usage.completion_tokens == 5, c
assert len(c.choices[0].logprobs.tokens) == 5, c

streamed = "".join(
    chunk.choices[0].text
    for chunk in client.completions.create(model="tiny-dsv3", prompt="Hello", max_tokens=5, seed=1, stream=True, extra_body={"ignore_eos": True})
    if chunk.choices
)
assert streamed == c.choices[0].text, (streamed, c.choices[0].text)

chat = client.chat.completions.create(
    model="tiny-dsv3",
    messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    max_completion_tokens=6,
    logprobs=True,
    top_logprobs=2,
    extra_body={"ignore_eos": True},
)
assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant", chat
assert len(chat.choices[0].logprobs.content) == 6, chat

chunks = list(
    client.chat.completions.create(
        model="tiny-dsv3",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
)
assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
assert chunks[-1].usage.completion_tokens == 6, chunks[-1]

for bad, status in [({"temperature": -1}, 400), ({"model": "nope"}, 404)]:
    try:
        client.completions.create(**{"model": "tiny-dsv3", "prompt": "Hi", **bad})
    except openai.APIStatusError as e:
        assert e.status_code == status, e
        assert e.body["message"], e.body
    else:
        raise AssertionError(f"{bad} was accepted")
# n > 1: several choices, one usage.
many = client.completions.create(model="tiny-dsv3", prompt="Hello", max_tokens=3, n=3, seed=4, extra_body={"ignore_eos": True})
assert sorted(ch.index for ch in many.choices) == [0, 1, 2], many
assert many.usage.completion_tokens == 9, many

# Structured output through the client's own parse helper (a pydantic model
# becomes a strict JSON schema). The model has random weights: only the
# constraint makes this parse. Bounded fields keep it short.
from typing import Literal

import pydantic


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    legs: int = pydantic.Field(ge=0, le=8)
    kind: Literal["cat", "dog", "bird"]


parsed = client.chat.completions.parse(
    model="tiny-dsv3", messages=[{"role": "user", "content": "A pet, as JSON."}], response_format=Pet, max_tokens=200, seed=2
)
pet = parsed.choices[0].message.parsed
assert isinstance(pet, Pet), parsed

# Tool calls: a forced call, its result on the next turn, and a streamed call
# to a named function. The bundled model's template has no tool syntax, so
# this is the generic format (tools described in a system message, the call
# emitted as constrained JSON).
import json

tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]
messages = [{"role": "user", "content": "Weather in Paris?"}]
first = client.chat.completions.create(model="tiny-dsv3", messages=messages, tools=tools, tool_choice="required", max_tokens=200, seed=5)
choice = first.choices[0]
assert choice.finish_reason == "tool_calls", first
call = choice.message.tool_calls[0]
assert call.type == "function" and call.id and call.function.name in ("get_weather", "get_time"), first
json.loads(call.function.arguments)
messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
second = client.chat.completions.create(model="tiny-dsv3", messages=messages, tools=tools, max_tokens=8, seed=6)
assert second.choices[0].finish_reason in ("stop", "length", "tool_calls"), second

named = {"type": "function", "function": {"name": "get_weather"}}
calls = {}
for chunk in client.chat.completions.create(model="tiny-dsv3", messages=messages[:1], tools=tools, tool_choice=named, max_tokens=200, seed=7, stream=True):
    if not chunk.choices:
        continue
    for delta in chunk.choices[0].delta.tool_calls or []:
        entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
        if delta.function.name:
            entry["name"] = delta.function.name
        entry["arguments"] += delta.function.arguments or ""
    if chunk.choices[0].finish_reason:
        assert chunk.choices[0].finish_reason == "tool_calls", chunk
assert [c["name"] for c in calls.values()] == ["get_weather"], calls
args = json.loads(calls[0]["arguments"])
assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f"), args
print("ok")
