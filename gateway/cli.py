"""The `servegate` command."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from advisor.bench.cli import bench

app = typer.Typer(help="servegate: LLM gateway, runtime advisor and TGI migration.", no_args_is_help=True)


@app.callback()
def main() -> None:
    """servegate: LLM gateway, runtime advisor and TGI migration."""


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    model: Annotated[str, typer.Option(
        help="GGUF file or Hugging Face directory for the built-in engine (default: SmolLM2-135M-Instruct).")] = "",
    served_name: Annotated[str, typer.Option(help="Model id clients use (default: from the file name).")] = "",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    kv_cache_tokens: Annotated[int, typer.Option(help="KV cache capacity in tokens.")] = 16384,
    kv_cache_dtype: Annotated[str, typer.Option(help="auto (the model's dtype) | int8")] = "auto",
    weight_quant: Annotated[str, typer.Option(help="none | int8 (CPU: int8 GEMMs, faster, not exact)")] = "none",
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget of one engine step.")] = 2048,
    max_model_len: Annotated[int, typer.Option(help="Context length cap (0: the model's own).")] = 0,
    no_prefix_caching: Annotated[bool, typer.Option(
        "--no-prefix-caching", help="Disable automatic prefix caching.")] = False,
    log_level: Annotated[str, typer.Option(help="debug | info | warning")] = "info",
) -> None:
    """Serve the OpenAI-compatible API in front of the built-in engine."""
    import uvicorn

    from backends.builtin import BuiltinBackend, EngineConfig

    from .app import create_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = EngineConfig(
        model=model, served_name=served_name, device=device, dtype=dtype, kv_cache_tokens=kv_cache_tokens,
        kv_cache_dtype=kv_cache_dtype, weight_quant=weight_quant,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len or None,
        enable_prefix_caching=not no_prefix_caching,
    )
    backend = BuiltinBackend(config)
    uvicorn.run(create_app({backend.model_id: backend}), host=host, port=port, log_level=log_level)


# `servegate bench` lives in the advisor: it is the advisor's measuring instrument too.
app.command(name="bench")(bench)
