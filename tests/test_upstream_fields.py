"""What reaches an upstream: a field no backend takes is refused before anything is sent, one its
backend takes passes, and structured outputs reach each runtime in its own spelling (or are refused
where it has none)."""

from __future__ import annotations

import json

import httpx
import pytest

from advisor.measure import stub
from backends.base import GenerateRequest
from backends.openai_compat import OpenAICompatConfig

from .conftest import AUTH, openai_upstream
from .upstreams import answer, gateway_over, remote


def recording(app, bodies: list[dict]):
    """`app`, recording each POSTed JSON body."""

    async def wrapper(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        body = await stub.read_body(receive)
        bodies.append(json.loads(body))

        async def replay():
            return {"type": "http.request", "body": body, "more_body": False}

        await app(scope, replay, send)

    return wrapper


@pytest.mark.slow
def test_unknown_fields_never_reach_an_upstream_unless_its_backend_takes_them(tmp_path):
    bodies: list[dict] = []
    upstream = recording(openai_upstream(lambda path: answer(count=2)), bodies)
    with gateway_over({"remote": upstream}, tmp_path) as gw:
        def ask(**fields) -> httpx.Response:
            return httpx.post(gw.url + "/v1/completions", headers=AUTH,
                              json={"model": "remote", "prompt": "hi", "max_tokens": 5, **fields})

        for field in ("n_predict", "priority", "lora_path", "best_of"):  # a way around billing, or none known
            refused = ask(**{field: 7})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
        assert not bodies  # nothing was sent
        assert ask(logprobs=2, user="u1", frequency_penalty=0.5, priority=0).status_code == 200
        assert bodies[-1]["logprobs"] == 2 and bodies[-1]["user"] == "u1" and "priority" not in bodies[-1]
        sent = len(bodies)
        tgi_style = httpx.post(gw.url + "/generate", headers=AUTH,  # TGI's adapter_id names a LoRA adapter
                               json={"inputs": "hi", "parameters": {"max_new_tokens": 5, "adapter_id": "x"}})
        assert tgi_style.status_code == 422 and "`x` does not exist" in tgi_style.json()["error"]
        assert len(bodies) == sent  # never sent upstream as the base model's request

    custom = remote("http://127.0.0.1:9")
    custom.config.extra_fields = ["house_knob"]
    assert custom.admit_extras(GenerateRequest("r", prompt="hi", extra={"house_knob": 1})).extra == {"house_knob": 1}


def test_structured_outputs_reach_each_runtime_in_its_own_spelling():
    """vLLM 0.32 reads only `structured_outputs`, SGLang `json_schema`/`regex`/`ebnf`, llama-server
    `json_schema` and GBNF `grammar`: the adapter rewrites, or refuses what its runtime cannot say."""
    from backends.base import InvalidRequest
    from backends.llamacpp import LlamaCppServerBackend, llama_server_config
    from backends.sglang import SGLangBackend
    from backends.tgi import TGIBackend
    from backends.vllm import VLLMBackend

    url = "http://127.0.0.1:9"
    vllm = VLLMBackend(OpenAICompatConfig(base_url=url, model="m"))
    sglang = SGLangBackend(OpenAICompatConfig(base_url=url, model="m"))
    llama = LlamaCppServerBackend(llama_server_config(url, "m"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    def sent(backend, **extra) -> dict:
        return backend.admit_extras(GenerateRequest("r", prompt="hi", extra=extra)).extra

    assert sent(vllm, guided_json=schema) == {"structured_outputs": {"json": schema}}
    assert sent(vllm, guided_choice=["a", "b"], user="u") == {"structured_outputs": {"choice": ["a", "b"]}, "user": "u"}
    assert sent(vllm, structured_outputs={"regex": "a+"}) == {"structured_outputs": {"regex": "a+"}}
    assert sent(sglang, structured_outputs={"json": schema}) == {"json_schema": json.dumps(schema)}
    assert sent(sglang, guided_choice=["a.b", "c"]) == {"regex": r"(a\.b|c)"}
    assert sent(sglang, structured_outputs={"grammar": 'root ::= "x"'}) == {"ebnf": 'root ::= "x"'}
    assert sent(llama, guided_json=schema) == {"json_schema": schema}
    assert sent(llama, structured_outputs={"choice": ["yes", "no"]}) == {"grammar": 'root ::= "yes" | "no"'}
    assert sent(llama, response_format={"type": "json_object"}) == {"response_format": {"type": "json_object"}}
    with pytest.raises(InvalidRequest) as refused:
        sent(llama, structured_outputs={"regex": "a+"})
    assert refused.value.param == "structured_outputs" and "regex" in refused.value.message
    tgi = TGIBackend(OpenAICompatConfig(base_url=url, model="m"))
    tgi.config.runtime = "tgi"  # as its start() sets it
    openai_shaped = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert sent(tgi, response_format=openai_shaped) == {"grammar": {"type": "json", "value": schema}}
    assert sent(tgi, structured_outputs={"regex": "a+"}) == {"grammar": {"type": "regex", "value": "a+"}}
    tgi_shaped = {"type": "json", "value": schema}
    assert sent(vllm, grammar=tgi_shaped) == {"structured_outputs": {"json": schema}}  # a TGI client, moved to vLLM
    chat = GenerateRequest("r", messages=[{"role": "user", "content": "hi"}],
                           extra={"response_format": openai_shaped})
    assert tgi._body(tgi.admit_extras(chat))[1]["response_format"] == tgi_shaped  # TGI's chat route: its own shape
