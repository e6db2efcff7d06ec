"""The applications' APIs beyond chat against vLLM's CPU build behind the gateway, through the
official `openai` SDK: a batch's whole flow (files, batches, polling, the output file), and
embeddings, from vLLM's pooling runner and from the built-in engine side by side."""

from __future__ import annotations

import io
import json
import math
import time

import openai
import pytest

from backends.builtin import BuiltinBackend, EngineConfig
from backends.openai_compat import OpenAICompatConfig
from backends.vllm import VLLMBackend

from .conftest import ADMIN_KEY, gateway_app, serve_app, usage_records, wait_ready

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(vllm_url, tmp_path_factory):
    backends = {"smollm2": VLLMBackend(OpenAICompatConfig(base_url=vllm_url, model="smollm2"), "vllm")}
    with serve_app(gateway_app(backends, tmp_path_factory.mktemp("gw"))) as url:
        wait_ready(url)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=ADMIN_KEY, max_retries=0), url


def run_batch(client: openai.OpenAI, endpoint: str, bodies: list[dict]) -> dict[str, dict]:
    """Each body's answer by custom id, once its batch completed."""
    content = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": endpoint, "body": body}) + "\n"
                      for i, body in enumerate(bodies))
    source = client.files.create(file=("in.jsonl", io.BytesIO(content.encode())), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint=endpoint, completion_window="24h")
    deadline = time.monotonic() + 300
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert batch.status == "in_progress" and time.monotonic() < deadline, batch
        time.sleep(0.5)
    assert batch.error_file_id is None and batch.request_counts.completed == len(bodies)
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    return {o["custom_id"]: o["response"] for o in output}


def test_a_batch_of_chat_completions_on_vllm(client):
    sdk, url = client
    questions = ["Name a colour.", "Name a fruit.", "Name a river.", "Name a planet."]
    bodies = [{"model": "smollm2", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": q}]}
              for q in questions]
    answers = run_batch(sdk, "/v1/chat/completions", bodies)
    assert sorted(answers) == [f"c{i}" for i in range(len(questions))]
    for i, question in enumerate(questions):  # greedy: what the same request answers interactively
        direct = sdk.chat.completions.create(model="smollm2", max_tokens=8, temperature=0,
                                             messages=[{"role": "user", "content": question}])
        body = answers[f"c{i}"]["body"]
        assert answers[f"c{i}"]["status_code"] == 200
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert body["usage"]["completion_tokens"] == direct.usage.completion_tokens
    billed = [r for r in usage_records(url, "default", 2 * len(questions)) if r["api"] == "batch"]
    assert len(billed) == len(questions) and all(r["backend"] == "vllm" for r in billed)


TEXTS = ["The river runs to the sea.", "Prime numbers have two divisors.", "Bees make honey in summer.",
         "A glacier is a river of ice.", "Owls hunt at night.", "Tea is brewed from leaves.",
         "Volcanoes erupt molten rock.", "Chess is played on sixty-four squares."]


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


@pytest.fixture(scope="module")
def embedders(vllm_embed_url, tmp_path_factory):
    backends = {"smollm2-embed": VLLMBackend(OpenAICompatConfig(base_url=vllm_embed_url, model="smollm2-embed",
                                                                embeddings=True), "vllm-embed"),
                "engine": BuiltinBackend(EngineConfig(dtype="float32", served_name="engine",
                                                      gguf_weights="dequantized"), "engine")}
    with serve_app(gateway_app(backends, tmp_path_factory.mktemp("gw"))) as url:
        wait_ready(url)
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=ADMIN_KEY, max_retries=0)
        deadline = time.monotonic() + 300
        while True:  # /ready says one backend is; both must be
            try:
                sdk.embeddings.create(model="engine", input="warm")
                break
            except openai.InternalServerError:
                assert time.monotonic() < deadline, "the engine did not load"
                time.sleep(1)
        yield sdk, url


def test_embeddings_from_vllm_and_the_engine_agree_through_the_sdk(embedders):
    sdk, url = embedders
    from_vllm = sdk.embeddings.create(model="smollm2-embed", input=TEXTS)  # base64 on the wire, as the SDK asks
    from_engine = sdk.embeddings.create(model="engine", input=TEXTS, encoding_format="float")
    assert from_vllm.usage.prompt_tokens == from_engine.usage.prompt_tokens > len(TEXTS)
    for a, b in zip(from_vllm.data, from_engine.data, strict=True):
        assert len(a.embedding) == len(b.embedding) == 576 and cosine(a.embedding, b.embedding) >= 0.999
    for model in ("smollm2-embed", "engine"):  # neither model was trained for Matryoshka
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            sdk.embeddings.create(model=model, input="x", dimensions=8)
    want = {("engine", from_engine.usage.prompt_tokens), ("vllm-embed", from_vllm.usage.prompt_tokens)}
    deadline = time.monotonic() + 10
    while not want <= (billed := {(r["backend"], r["prompt_tokens"]) for r in usage_records(url, "default")
                                  if r["status"] == "ok"}):
        assert time.monotonic() < deadline, billed
        time.sleep(0.1)
