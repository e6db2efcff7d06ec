"""llama.cpp behind the Backend interface.

Remote mode: a `llama-server` (llama.cpp's C++ server) or llama-cpp-python's
`python -m llama_cpp.server`, both OpenAI-compatible, through the generic adapter with what
differs: llama-cpp-python's server has no `/health` (its model list answers instead), sends no
usage in streams, reports a request that fails validation as a 500 ("1 validation error:
..."), which is the client's fault, not the server's, and answers a streamed prompt longer
than its context with an empty 200 stream; the adapter then counts the prompt's tokens with
the server's tokenizer to say what went wrong.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp

from .base import BackendError, ContextTooLong, Event, GenerateRequest, InvalidRequest, UpstreamError
from .openai_compat import OpenAICompatBackend, OpenAICompatConfig, error_from_status


def llama_server_config(base_url: str, model: str, python_server: bool = False, **options) -> OpenAICompatConfig:
    """`python_server`: llama-cpp-python's server rather than llama.cpp's `llama-server`."""
    runtime = "llama-cpp-python" if python_server else "llama.cpp"
    return OpenAICompatConfig(base_url=base_url, model=model, runtime=runtime,
                              health_path="/v1/models" if python_server else "/health", **options)


class LlamaCppServerBackend(OpenAICompatBackend):
    def error_for_status(self, status: int, body: bytes) -> BackendError:
        error = error_from_status(status, body)
        if status == 500 and "validation error" in error.message:
            return InvalidRequest(error.message.removeprefix("upstream answered 500: "))
        return error

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        produced = False
        try:
            async for event in super().generate(request):
                produced = True
                yield event
        except UpstreamError as exc:
            if produced:
                raise
            raise await self._diagnose(request, exc) from exc

    async def _diagnose(self, request: GenerateRequest, error: UpstreamError) -> BackendError:
        """Why a stream came back empty: a prompt too long for the context, or `error`."""
        python_server = self.config.runtime == "llama-cpp-python"
        text = request.prompt if request.prompt is not None else " ".join(
            str(m.get("content") or "") for m in request.messages or ())
        path, body = ("/extras/tokenize/count", {"input": text}) if python_server else ("/tokenize", {"content": text})
        answer = None
        for _ in range(2):  # the server drops the connection of the failed stream: a pooled one may be dead
            try:
                async with self.client.post(path, json=body, timeout=aiohttp.ClientTimeout(total=30)) as response:
                    answer = await response.json(content_type=None)
                break
            except aiohttp.ClientConnectionError:  # reset or disconnected: once more, on a fresh connection
                continue
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return error
        count = answer.get("count", len(answer.get("tokens") or ())) if isinstance(answer, dict) else 0
        if request.prompt_token_ids is not None:
            count = len(request.prompt_token_ids)
        context = (await self.capabilities()).max_context
        if context and count + (request.max_tokens or 0) > context:
            return ContextTooLong(f"the prompt has {count} tokens and max_tokens is {request.max_tokens}: "
                                  f"more than the model's context of {context} tokens", param="prompt")
        return error
