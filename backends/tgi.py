"""Hugging Face TGI as a backend, through its native API.

Prompts go to `/generate_stream` (events `data:{...}` with one token each, no `[DONE]`, the last
one carrying `details`; errors arrive as `{"error", "error_type"}` events on a 200 stream);
chat goes to TGI's OpenAI-compatible `/v1/chat/completions`, which applies the model's template.
`/info` gives the capabilities, `/health` the health. Facts: TGI's `router/src/server.rs` and
`docs/openapi.json` (TGI 3.3), summarized in the project's reference notes.

LoRA (TGI 3.3.7): adapters load at launch only (`--lora-adapters`, the LORA_ADAPTERS environment
variable, `ID` or `ID=PATH` each), and no route lists them: the backend is told their ids
(`adapters`). `/generate_stream` names one by `parameters.adapter_id`; the chat route takes its
`model` as the adapter id unless it is "tgi" (`router/src/server.rs`, `lib.rs`). The router passes
the id on unchecked (`validation.rs`), and the shard runs an id it did not load as the base model
(`server/text_generation_server/models/flash_causal_lm.py`, `ADAPTER_TO_INDEX.get(adapter_id, 0)`):
an adapter this backend was not told of is refused here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from . import fields
from .base import (
    Adapter,
    BackendError,
    Capabilities,
    ContextTooLong,
    Delta,
    Event,
    Finish,
    GenerateRequest,
    InvalidRequest,
    Load,
    ModelNotFound,
    Overloaded,
    TokenSpan,
    UpstreamError,
    Usage,
    reported_count,
)
from .openai_compat import OpenAICompatBackend, OpenAICompatConfig, error_from_status, message_of, says_too_long

FINISH_REASONS = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


def tgi_error(error_type: str | None, message: str) -> BackendError:
    """TGI's error types (`infer/mod.rs` `error_type()`) in the taxonomy."""
    if error_type in ("validation", "template_error", "missing_template_variable", "tool_error"):
        return (ContextTooLong if says_too_long(message) else InvalidRequest)(message)
    if error_type == "overloaded":
        return Overloaded(message)
    return UpstreamError(f"TGI {error_type or 'error'}: {message}")


class TGIBackend(OpenAICompatBackend):
    FINISH_REASONS = FINISH_REASONS
    EXTRA_FIELDS = fields.TGI

    def __init__(self, config: OpenAICompatConfig, name: str = "tgi") -> None:
        if config.embeddings:
            raise ValueError(f"backend {name!r}: TGI serves no embeddings (its sibling, Text Embeddings Inference, "
                             "does): drop the `embeddings` option")
        super().__init__(config, name)
        self._info: dict = {}
        self.adapters = frozenset(config.adapters)

    async def start(self) -> None:
        self.config.runtime = "tgi"
        await super().start()
        self._info = await self.get_json("/info")
        self._max_context = self.config.max_context or reported_count(self._info.get("max_total_tokens"))

    def error_for_status(self, status: int, body: bytes) -> BackendError:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and "error_type" in parsed:  # TGI's own shape
            return tgi_error(parsed["error_type"], message_of(parsed))
        return error_from_status(status, body)

    def _body(self, request: GenerateRequest) -> tuple[str, dict]:
        """The chat route validates like `/generate`: `top_p` must be < 1 (`validation.rs`
        `ValidationError::TopP`, TGI issue #2222), so 1.0, no cut, is said by leaving it out. It
        reads `/generate`'s `grammar` object as `response_format`."""
        path, body = super()._body(request)
        if body.get("top_p") == 1.0:
            del body["top_p"]
        if "grammar" in body:
            body["response_format"] = body.pop("grammar")
        return path, body

    async def _model_max_len(self) -> int:
        return 0  # TGI says it in /info, read at start

    def upstream_model(self, request: GenerateRequest) -> str:
        """The chat route's `model` is the adapter id."""
        if request.adapter is None:
            return self.config.model
        if request.adapter not in self.adapters:  # TGI would answer with the base model
            raise ModelNotFound(f"TGI backend {self.name!r} has no LoRA adapter {request.adapter!r}", param="model")
        return request.adapter

    async def load_adapter(self, adapter: Adapter) -> None:
        if adapter.name not in self.config.adapters:
            raise InvalidRequest(f"TGI loads LoRA adapters at launch only (--lora-adapters): {adapter.name!r} is not "
                                 f"among those backend {self.name!r} was started with", param="model")
        self.adapters |= {adapter.name}

    async def unload_adapter(self, name: str) -> None:
        """Forgotten here; TGI keeps it loaded."""
        if name not in self.adapters:
            await super().unload_adapter(name)
        self.adapters -= {name}

    def _parameters(self, request: GenerateRequest) -> dict:
        params = {**request.extra, "details": True, "max_new_tokens": request.max_tokens, "seed": request.seed,
                  "stop": list(request.stop),
                  "adapter_id": None if request.adapter is None else self.upstream_model(request)}
        if request.temperature >= 1e-5:  # TGI is greedy unless asked to sample
            params |= {"do_sample": True, "temperature": request.temperature,
                       "top_p": None if request.top_p == 1.0 else request.top_p,  # as in `_body`
                       "top_k": request.top_k or None}
        return {k: v for k, v in params.items() if v is not None}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        if request.n != 1:
            raise InvalidRequest("TGI generates one sequence per request: n must be 1", param="n")
        if request.messages is not None:  # TGI's OpenAI-compatible route applies the chat template
            async for event in super().generate(request):
                yield event
            return
        if request.prompt is None:
            raise InvalidRequest("TGI takes text prompts, not token ids", param="prompt")
        body = {"inputs": request.prompt, "parameters": self._parameters(request)}
        async for event in self.stream_events("/generate_stream", body, request.trace_headers):
            if "error" in event:
                raise tgi_error(event.get("error_type"), message_of(event))
            token = event.get("token") or {}
            text = "" if token.get("special") else token.get("text", "")
            details = event.get("details")
            if details is None:
                yield Delta(0, text, (token["id"],) if "id" in token else ())
                continue
            reason = FINISH_REASONS.get(details.get("finish_reason"), "stop")
            yield Delta(0, text, (token["id"],) if "id" in token else (), reason)
            yield Finish((reason,), Usage(details.get("input_length") or 0, details.get("generated_tokens") or 0))
            return
        raise UpstreamError("TGI ended the stream without its final event (incomplete generation)")

    async def tokenize(self, text: str) -> list[TokenSpan]:
        """TGI's `/tokenize`: `[{id, text, start, stop}]`."""
        async with self.client.post("/tokenize", json={"inputs": text}) as response:
            if response.status != 200:
                raise self.error_for_status(response.status, await response.read())
            tokens = await response.json(content_type=None)
        return [TokenSpan(t["id"], t["text"], t["start"], t["stop"]) for t in tokens]

    async def load(self) -> Load:
        """From TGI's `tgi_*` metrics: the running batch and the queue."""
        m = await self.scrape()
        return Load(running=reported_count(m.total("tgi_batch_current_size")),
                    waiting=reported_count(m.total("tgi_queue_size")),
                    details=m.pick(batch_current_max_tokens="tgi_batch_current_max_tokens"),
                    resident_adapters=self.adapters)  # all of them, from its launch on

    async def capabilities(self) -> Capabilities:
        return Capabilities(runtime="tgi", version=str(self._info.get("version", "")),
                            model=str(self._info.get("model_id") or self.config.model), max_context=self._max_context,
                            # TGI 3: PREFIX_CACHING defaults to true, but to false beside LoRA adapters
                            # (launcher/src/main.rs `resolve_attention`)
                            prefix_caching=not self.config.adapters,
                            tokenize=True,
                            # a batch mixes every adapter it loaded (segmented by adapter, layers/lora.py)
                            max_loras=len(self.config.adapters), max_lora_rank=self.config.max_lora_rank,
                            adapters=self.adapters)
