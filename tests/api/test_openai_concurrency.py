"""More streaming chat clients than rows (36 > 32): each stream carries its own answer, nobody else's."""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI

CLIENTS = 36
MAX_TOKENS = 6
THINGS = [
    "apples",
    "rivers",
    "clocks",
    "tigers",
    "violins",
    "glaciers",
    "bread",
    "comets",
    "lanterns",
    "owls",
    "deserts",
    "pianos",
    "bridges",
    "honey",
    "storms",
    "castles",
    "whales",
    "maps",
    "candles",
    "forests",
    "trains",
    "mirrors",
    "islands",
    "kites",
    "tea",
    "volcanoes",
    "robots",
    "gardens",
    "snow",
    "ships",
    "books",
    "bees",
    "rockets",
    "coral",
    "chess",
    "wolves",
]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Say something about {THINGS[i]} (request {i})."}]


def test_36_concurrent_streaming_chats_each_get_their_own_answer(real_server, model_name):
    async def run() -> tuple[list[str], list[str], list[str]]:
        async with AsyncOpenAI(
            base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:

            async def alone(i: int) -> str:
                out = await client.chat.completions.create(
                    model=model_name, messages=messages(i), max_tokens=MAX_TOKENS, temperature=0
                )
                return out.choices[0].message.content

            async def streamed(i: int) -> tuple[str, str]:
                stream = await client.chat.completions.create(
                    model=model_name, messages=messages(i), max_tokens=MAX_TOKENS, temperature=0, stream=True
                )
                ids, parts = set(), []
                async for chunk in stream:
                    ids.add(chunk.id)
                    parts.extend(c.delta.content or "" for c in chunk.choices)
                assert len(ids) == 1
                return "".join(parts), ids.pop()

            singles = [await alone(i) for i in range(CLIENTS)]  # one at a time: the reference answers
            together = await asyncio.gather(*(streamed(i) for i in range(CLIENTS)))
            return singles, [t for t, _ in together], [i for _, i in together]

    singles, together, ids = asyncio.run(run())
    assert len(set(ids)) == CLIENTS
    assert len(set(singles)) > CLIENTS // 2  # the prompts really ask for different answers
    mismatched = [(i, s, t) for i, (s, t) in enumerate(zip(singles, together)) if s != t]
    assert not mismatched, mismatched
    assert real_server.wait_idle()["open_sessions"] == 0
