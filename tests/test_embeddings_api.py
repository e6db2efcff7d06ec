"""`/v1/embeddings` on the gateway through the official `openai` SDK: both encodings, billing as
prompt tokens (at the batch price in a batch), a model that does not embed, bad input."""

from __future__ import annotations

import asyncio
import io
import json
import time

import httpx
import openai
import pytest

from backends.base import Backend, Capabilities, Embeddings, EmbedRequest, Health, Load, Price

from .conftest import ADMIN_KEY, AUTH, gateway_app, serve_app, usage_records, wait_ready


class Embedder(Backend):
    """Vectors that spell their input: a model's pooled states stand-in, counting one token per word."""

    def __init__(self, name: str, embeds: bool = True) -> None:
        self.name, self.embeds, self.asked = name, embeds, []

    def generate(self, request):
        raise NotImplementedError

    async def capabilities(self) -> Capabilities:
        return Capabilities("fake", "1", "embedder", 512, False, embeddings=self.embeds, price=Price(2, 0))

    async def health(self) -> Health:
        return Health.READY

    async def load(self) -> Load:
        return Load()

    async def embed(self, request: EmbedRequest) -> Embeddings:
        self.asked.append(request)
        await asyncio.sleep(0)
        vectors = [[len(x) / 7, 1 / 3, -0.25][: request.dimensions or 3] for x in request.inputs]
        return Embeddings(vectors, sum(len(x.split()) if isinstance(x, str) else len(x) for x in request.inputs))


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    embedder = Embedder("embedder")
    app = gateway_app({"embedder": embedder, "chat-only": Embedder("chat-only", embeds=False)},
                      tmp_path_factory.mktemp("gw"))
    with serve_app(app) as url:
        wait_ready(url)
        yield url, embedder


def test_the_sdk_gets_vectors_in_either_encoding_billed_as_prompt_tokens(gw):
    url, embedder = gw
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=ADMIN_KEY, max_retries=0)
    texts = ["one two three", "four", "five six"]
    got = client.embeddings.create(model="embedder", input=texts)  # the SDK asks for base64 and decodes it
    want = [[len(t) / 7, 1 / 3, -0.25] for t in texts]
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == "embedder"
    for vector, expected in zip((d.embedding for d in got.data), want, strict=True):
        assert vector == pytest.approx(expected, rel=1e-6)  # float32 on the wire
    assert (got.usage.prompt_tokens, got.usage.total_tokens) == (6, 6)
    floats = client.embeddings.create(model="embedder", input="seven", encoding_format="float", dimensions=2)
    assert floats.data[0].embedding == [5 / 7, 1 / 3] and embedder.asked[-1].dimensions == 2
    ids = client.embeddings.create(model="embedder", input=[[1, 2, 3, 4]], encoding_format="float")
    assert embedder.asked[-1].inputs == ((1, 2, 3, 4),) and ids.usage.prompt_tokens == 4
    records = [r for r in usage_records(url, "default", 3) if r["api"] == "embeddings"]
    assert sorted(r["prompt_tokens"] for r in records) == [1, 4, 6]
    assert all(r["completion_tokens"] == 0 and r["status"] == "ok" for r in records)
    assert sorted(r["cost_nano_usd"] for r in records) == [2000, 8000, 12000]  # $2 per million tokens


def test_bad_input_and_a_model_that_does_not_embed_are_named(gw):
    url, _ = gw
    post = lambda body: httpx.post(f"{url}/v1/embeddings", json=body, headers=AUTH, timeout=30)  # noqa: E731
    for body, param in (({"model": "chat-only", "input": "x"}, "model"), ({"model": "embedder", "input": []}, "input"),
                        ({"model": "embedder", "input": ["a", ""]}, "input"),
                        ({"model": "embedder", "input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({"model": "embedder", "input": "a", "dimensions": 0}, "dimensions"),
                        ({"model": "embedder", "input": "a", "extra": 1}, "extra"),
                        ({"model": "nobody", "input": "a"}, "model")):
        response = post(body)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, (body, response.text)
    assert post({"model": "embedder", "input": ["a"] * 2049}).json()["error"]["param"] == "input"


def test_a_batch_of_embeddings_is_billed_at_the_batch_price(gw):
    url, _ = gw
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=ADMIN_KEY, max_retries=0)
    lines = "".join(json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": "embedder", "input": ["a b c d"] * (i + 1)}}) + "\n"
                    for i in range(3))
    source = client.files.create(file=("e.jsonl", io.BytesIO(lines.encode())), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline and batch.status == "in_progress", batch
        time.sleep(0.1)
    assert batch.output_file_id, (batch, batch.error_file_id and client.files.content(batch.error_file_id).text)
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert {o["custom_id"]: len(o["response"]["body"]["data"]) for o in output} == {"e0": 1, "e1": 2, "e2": 3}
    deadline = time.monotonic() + 10
    while len(billed := [r for r in usage_records(url, "default") if r["api"] == "batch"]) < 3:
        assert time.monotonic() < deadline, billed
        time.sleep(0.1)
    assert sorted((r["prompt_tokens"], r["cost_nano_usd"]) for r in billed) == [(4, 4000), (8, 8000), (12, 12000)]
    assert output[0]["response"]["body"]["usage"]["prompt_tokens"] == 4
