"""The applications' APIs beyond chat against vLLM's CPU build behind the gateway, through the
official `openai` SDK: a batch's whole flow (files, batches, polling, the output file)."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

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
