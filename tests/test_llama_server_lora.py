"""A LoRA adapter on the peers' llama-server through its backend: a PEFT adapter converted by
llama.cpp's converter, given at launch, made servable by its path; a request naming it runs it, one
naming none runs the base though llama-server would apply the launch's scale (1.0) to a request that
does not say `lora`; an adapter not given at launch is refused. Skips, saying why, where llama-server
or the converter is not provisioned (`python -m backends.peers llama-server lora-converter`)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from backends import peers
from backends.base import Adapter, InvalidRequest
from backends.default_model import default_model_path
from backends.launch import free_port, supervised
from backends.llamacpp import LlamaCppServerBackend, llama_server_config
from tests.lora_adapters import ADAPTERS, make_adapter

from .conftest import generated, provisioned_or_skip

pytestmark = pytest.mark.slow

PROMPT = "The primary colors are"


def test_an_adapter_given_at_launch_is_served_by_name_and_only_where_named(default_model_dir, tmp_path):
    provisioned_or_skip(peers.llama_server)
    converter = provisioned_or_skip(peers.lora_converter)
    peft = make_adapter(default_model_dir, tmp_path / "chat", *ADAPTERS["chat"])
    gguf = tmp_path / "chat.gguf"
    subprocess.run([sys.executable, str(converter), str(peft), "--base", str(default_model_dir), "--outfile",
                    str(gguf), "--outtype", "f32"], check=True, capture_output=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = peers.llama_server_command(default_model_path(), port, "smollm2") + [
        "--lora", str(gguf), "--lora-init-without-apply"]

    async def scenario():
        backend = LlamaCppServerBackend(llama_server_config(url, "smollm2"))
        await backend.start()
        try:
            await backend.load_adapter(Adapter("chat", str(gguf)))
            with pytest.raises(InvalidRequest, match="at launch only"):
                await backend.load_adapter(Adapter("sql", str(peft)))
            adapted, _ = await generated(backend, prompt=PROMPT, max_tokens=16, adapter="chat")
            base, _ = await generated(backend, prompt=PROMPT, max_tokens=16)
            return adapted, base, await backend.capabilities()
        finally:
            await backend.close()

    with supervised(command, url, "/health", timeout_s=300):
        adapted, base, caps = asyncio.run(scenario())
        # Uncached: a request without `lora` would reuse a slot's prompt computed under other scales
        # (server-context.cpp compares a slot's adapters only for a request that says `lora`).
        unnamed = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "smollm2", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "cache_prompt": False,
        }).json()["choices"][0]["text"]
    assert adapted != base  # the check can fail
    assert unnamed == adapted  # llama-server's own default: the launch's scale, though "without apply"
    assert caps.adapters == {"chat"} and caps.max_loras == 1
