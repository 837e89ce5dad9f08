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
print("ok")
