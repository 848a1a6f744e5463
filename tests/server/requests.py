"""The requests the server tests send, and the openai-client calls that send them.

Every answer is greedy (temperature 0) and MAX_TOKENS long (the fixture model never
emits its end token). Non-streaming answers carry their token ids (logprobs=True), so
equality with the stock server is checked token for token.
"""

from __future__ import annotations

from openai import OpenAI

from tests.server.model_dir import text

MAX_TOKENS = 24
BLOCK = 128  # KVPolicy's default block_size_tokens, which serve-model uses by default
SYSTEM = text(250, seed=1)  # ~540 tokens with the fixture tokenizer


def messages(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


REQUESTS = {
    "A": messages("hello world, what is a page store"),
    "B": messages("one two three four"),
    "C": messages("red green blue, the quick brown fox"),
    "D": messages("alpha beta gamma delta"),
}


def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(server, msgs) -> dict:
    """Non-streaming; the answer's token ids come from logprobs."""
    r = client(server).chat.completions.create(model="default_model", messages=msgs,
                                                temperature=0, max_tokens=MAX_TOKENS,
                                                logprobs=True)
    body = r.model_dump()
    ids = [entry["id"] for entry in body["choices"][0]["logprobs"]["content"]]
    details = body["usage"].get("prompt_tokens_details") or {}
    return {"text": r.choices[0].message.content, "ids": ids,
            "prompt_tokens": r.usage.prompt_tokens, "cached": details.get("cached_tokens")}


def chat_stream(server, msgs, after_first_chunk=None) -> dict:
    """Streaming with usage; after_first_chunk() runs once the first piece arrived."""
    stream = client(server).chat.completions.create(
        model="default_model", messages=msgs, temperature=0, max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            if after_first_chunk is not None:
                after_first_chunk()
                after_first_chunk = None
        if chunk.usage is not None:
            usage = chunk.usage
    return {"text": "".join(pieces), "prompt_tokens": usage.prompt_tokens,
            "cached": usage.prompt_tokens_details.cached_tokens}


def prompt_ids(model_dir, msgs) -> list[int]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(model_dir).apply_chat_template(msgs, add_generation_prompt=True)


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
