"""llama.cpp behind the Backend interface, in process (`LlamaCppBackend`) or remote.

Remote mode: a `llama-server` (llama.cpp's C++ server) or llama-cpp-python's
`python -m llama_cpp.server`, both OpenAI-compatible, through the generic adapter with what
differs: llama-cpp-python's server has no `/health` (its model list answers instead), sends no
usage in streams, reports a request that fails validation as a 500 ("1 validation error:
..."), which is the client's fault, not the server's, and answers a streamed prompt longer
than its context with an empty 200 stream; the adapter then counts the prompt's tokens with
the server's tokenizer, or asks it once more without streaming, to say what went wrong. A
text prompt's tokens are counted by its `/extras/tokenize/count`. llama-server says a prompt
does not fit with the error type `exceed_context_size_error` and answers `/health` with 503
while it loads its model.

LoRA: llama.cpp reads GGUF adapters only (a PEFT directory converts with its
`convert_lora_to_gguf.py`), and both loaders take them at load time only. llama-server (the build
`backends.peers` makes, llama-cpp-python 0.3.36's vendored llama.cpp) loads `--lora FILE` at launch
(`common/arg.cpp`), lists them by id and path at `GET /lora-adapters`, and applies the ones a
request's `lora` ([{id, scale}], any route; those left out at scale 0) names
(`tools/server/server-schema.cpp`, `server-context.cpp` `construct_lora_list`); a request without
`lora` gets every adapter at its launch scale, 1.0 even with `--lora-init-without-apply` (which only
skips applying them at load, `common/common.cpp`), and only a request that says `lora` has its slot's
cached prompt checked against its adapters (`launch_slot_with_task`): this backend always sends it.
Requests of another adapter set never share a batch (`server_slot::can_batch_with`). llama-cpp-python's `Llama` applies
one `lora_path` to the whole model when it loads it (`llama_cpp/llama.py`).

Embeddings (the `embeddings` option): llama-server serves `/v1/embeddings` only when started with
`--embeddings` (else a 501), and only with a pooling other than none (`--pooling last|mean|cls`; a
GGUF without a pooling key has none: a 400), L2-normalized by default (`--embd-normalize 2`),
beside its completions (`server-context.cpp` `handle_embeddings_impl`); it reads no `dimensions`.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path, PurePath
from typing import Any

import aiohttp

from . import fields
from .base import (
    MAX_LOGPROBS,
    Adapter,
    Backend,
    BackendError,
    Capabilities,
    ContextTooLong,
    Delta,
    Embeddings,
    EmbedRequest,
    Event,
    Finish,
    GenerateRequest,
    Health,
    InvalidRequest,
    Load,
    ModelNotFound,
    TokenSpan,
    Unavailable,
    UpstreamError,
    Usage,
    check_sampling,
    reported_count,
    text_only,
)
from .cpu import llama_cpp_safe
from .openai_compat import OpenAICompatBackend, OpenAICompatConfig, error_for, error_parts
from .tokenization import spans

# What llama.cpp's servers answer with a 500 though the request is at fault, which would count
# against their breaker as their own failure: llama-cpp-python's server's pydantic "validation
# error"; llama-server's chat parser wraps a malformed message or tool in a runtime error
# (`common/chat.cpp`), and its media loader refuses a modality it has no projector for or an
# image it cannot fetch or decode (`tools/server/server-common.cpp`).
CLIENT_FAULTS_SENT_AS_500 = ("validation error", "Failed to parse messages", "Failed to parse tools",
                             "input is not supported", "Failed to download image", "Invalid base64 value")


def llama_server_config(base_url: str, model: str, python_server: bool = False, **options) -> OpenAICompatConfig:
    """`python_server`: llama-cpp-python's server rather than llama.cpp's `llama-server`."""
    runtime = "llama-cpp-server" if python_server else "llama-server"
    return OpenAICompatConfig(base_url=base_url, model=model, runtime=runtime,
                              health_path="/v1/models" if python_server else "/health", **options)


class LlamaCppServerBackend(OpenAICompatBackend):
    EXTRA_FIELDS = fields.LLAMA_SERVER

    def __init__(self, config: OpenAICompatConfig, name: str = "llama-server") -> None:
        super().__init__(config, name)
        self.python_server = config.runtime == "llama-cpp-server"
        if self.python_server:
            self.EXTRA_FIELDS = fields.LLAMA_CPP_SERVER
        self.props: dict = {}
        self.launched_loras: list[dict] = []  # llama-server's `/lora-adapters`: {id, path, scale}
        self.lora_ids: dict[str, int] = {}  # the adapters servable by name, and their ids

    async def start(self) -> None:
        """llama-server's `/props`: its build (`build_info`, e.g. "b6500-3f4ed9a7"), its slots and
        each slot's context (`default_generation_settings.n_ctx`) when `/v1/models` has none; the
        LoRA adapters it loaded."""
        await super().start()
        if not self.python_server:
            self.props = await self.get_json("/props")
            n_ctx = (self.props.get("default_generation_settings") or {}).get("n_ctx")
            self._max_context = self._max_context or reported_count(n_ctx)
            self.launched_loras = [a for a in await self.get_json("/lora-adapters", list) if isinstance(a, dict)]

    async def capabilities(self) -> Capabilities:
        return Capabilities(runtime=self.config.runtime, version=str(self.props.get("build_info", "")),
                            model=self.config.model, max_context=self._max_context,
                            prefix_caching=not self.python_server,  # llama-server: cache_prompt, on by default
                            tokenize=not self.python_server, max_loras=1 if self.launched_loras else 0,
                            adapters=frozenset(self.lora_ids), embeddings=self.config.embeddings)

    async def embed(self, request: EmbedRequest) -> Embeddings:
        if request.dimensions is not None and self.config.embeddings:  # it would answer whole vectors
            raise InvalidRequest("llama.cpp's servers do not shorten embeddings: leave dimensions out",
                                 param="dimensions")
        return await super().embed(request)

    async def load_adapter(self, adapter: Adapter) -> None:
        """Servable by name where llama-server loaded its file at launch."""
        if self.python_server:
            await super().load_adapter(adapter)  # refused: it applies one adapter to the whole model (--lora_path)
        found = next((a for a in self.launched_loras if PurePath(str(a.get("path"))) == PurePath(adapter.path)), None)
        if found is None:
            raise InvalidRequest(f"llama-server loads LoRA adapters at launch only (--lora FILE, a GGUF file; a PEFT "
                                 f"directory converts with llama.cpp's convert_lora_to_gguf.py): {adapter.path} is not "
                                 f"among those backend {self.name!r} was started with", param="model")
        self.lora_ids[adapter.name] = found["id"]

    async def unload_adapter(self, name: str) -> None:
        """Forgotten here; llama-server keeps it loaded."""
        if name not in self.lora_ids:
            await super().unload_adapter(name)
        del self.lora_ids[name]

    def upstream_model(self, request: GenerateRequest) -> str:
        """llama-server names an adapter in `lora` (`_body`), the model staying the base."""
        return super().upstream_model(request) if self.python_server else self.config.model

    def _body(self, request: GenerateRequest) -> tuple[str, dict]:
        """llama-server reuses a slot's cached prompt prefix when the request asks (`cache_prompt`,
        default true in current builds, off in older ones): ask explicitly, unless the client chose."""
        path, body = super()._body(request)
        if not self.python_server:
            body.setdefault("cache_prompt", True)
            if request.adapter is not None:  # at PEFT's scale: llama.cpp multiplies alpha / rank by it
                if request.adapter not in self.lora_ids:
                    raise ModelNotFound(f"backend {self.name!r} has no LoRA adapter {request.adapter!r}", param="model")
                body["lora"] = [{"id": self.lora_ids[request.adapter], "scale": 1.0}]
            elif self.launched_loras:  # none, or each applies at its launch scale
                body["lora"] = [{"id": self.launched_loras[0]["id"], "scale": 0.0}]
        elif request.messages is not None:  # its template reads strings only
            body["messages"] = text_only(request.messages)
        return path, body

    async def load(self) -> Load:
        """From llama-server's `llamacpp:*` metrics (with `--metrics`), else from `/slots` (on by
        default): the slots processing a request. llama-cpp-python's server has neither."""
        m = await self.scrape()
        resident = frozenset(self.lora_ids)  # every adapter it loaded stays in memory
        if m or self.python_server:
            return Load(running=reported_count(m.total("llamacpp:requests_processing")),
                        waiting=reported_count(m.total("llamacpp:requests_deferred")),
                        details=m.pick(prompt_tokens_total="llamacpp:prompt_tokens_total",
                                       tokens_predicted_total="llamacpp:tokens_predicted_total"),
                        resident_adapters=resident)
        slots = await self.get_json("/slots", list)
        return Load(running=sum(bool(slot.get("is_processing")) for slot in slots),
                    details={"slots": float(len(slots))} if slots else {}, resident_adapters=resident)

    async def tokenize(self, text: str) -> list[TokenSpan]:
        """llama-server's `/tokenize` with `with_pieces`: each token's piece, as text or, where
        a piece is not valid UTF-8, as a list of bytes."""
        if self.python_server:
            return await super().tokenize(text)
        async with self.client.post("/tokenize", json={"content": text, "with_pieces": True}) as response:
            if response.status != 200:
                raise self.error_for_status(response.status, await response.read())
            tokens = (await response.json(content_type=None)).get("tokens", [])
        pieces = [bytes(t["piece"]) if isinstance(t["piece"], list) else t["piece"].encode() for t in tokens]
        return spans(text, [t["id"] for t in tokens], pieces)

    def error_for_status(self, status: int, body: bytes) -> BackendError:
        message, kind = error_parts(body)
        if status == 500 and any(fault in message for fault in CLIENT_FAULTS_SENT_AS_500):
            return InvalidRequest(message)
        return error_for(status, message, kind)

    def health_of(self, status: int) -> Health:
        """llama-server answers 503 ("Loading model", `unavailable_error`) until its model is loaded."""
        return Health.LOADING if status == 503 and not self.python_server else super().health_of(status)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        check_llamacpp_sampling(request)
        self._check_forced_tool_call(request)
        produced = False
        try:
            async for event in super().generate(request):
                produced = True
                yield event
        except UpstreamError as exc:
            if produced:
                raise
            raise await self._diagnose(request, exc) from exc

    def _check_forced_tool_call(self, request: GenerateRequest) -> None:
        """A forced tool call (`tool_choice` "required" or a named function) that the server would
        answer with plain text, breaking OpenAI's contract, is refused by name instead.
        llama-server drops the tools of a chat whose template has none (`/props`'
        `chat_template_caps.supports_tools`; the default model's); llama-cpp-python's handler for
        a GGUF's template forces a named function by grammar, never "required"
        (`llama_cpp/llama_chat_format.py`). "auto" may answer text, so it passes."""
        choice = request.extra.get("tool_choice")
        if not request.extra.get("tools") or not (choice == "required" or isinstance(choice, dict)):
            return
        if self.python_server:
            answered_with_text = choice == "required"
        else:
            answered_with_text = (self.props.get("chat_template_caps") or {}).get("supports_tools") is False
        if answered_with_text:
            raise InvalidRequest(f"this model's chat template on {self.config.runtime} cannot force a tool call "
                                 f"(tool_choice {json.dumps(choice)})", param="tool_choice")

    async def _diagnose(self, request: GenerateRequest, error: UpstreamError) -> BackendError:
        """Why a stream came back empty: a prompt too long for the context, or `error`. Where the
        context is unknown (llama-cpp-python's server says it nowhere), the request is asked once
        more without streaming for one token: that answer carries the server's own error."""
        context = (await self.capabilities()).max_context
        try:  # the server dropped the failed stream's connection: _post retries a dead pooled one
            if not context:
                path, body = self._body(request)
                body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False, "max_tokens": 1}
                async with await self._post(path, body, timeout=aiohttp.ClientTimeout(total=60)) as response:
                    failed = response.status >= 400
                    return self.error_for_status(response.status, await response.read()) if failed else error
            count = await self.exact_prompt_tokens(request)
            if count is None:  # a chat on llama-cpp-python's server, which renders chats nowhere: its text
                count = await self._count(" ".join(str(m.get("content") or "") for m in request.messages))
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, BackendError):
            return error
        if count + (request.max_tokens or 0) > context:
            return ContextTooLong(f"the prompt has {count} tokens and max_tokens is {request.max_tokens}: "
                                  f"more than the model's context of {context} tokens", param="prompt")
        return error

    async def _count(self, text: str) -> int:
        """Tokens in `text` by the server's own tokenizer (with BOS where the model adds one)."""
        path, body = ("/extras/tokenize/count", {"input": text}) if self.python_server \
            else ("/tokenize", {"content": text, "add_special": True})
        async with await self._post(path, body, timeout=aiohttp.ClientTimeout(total=30)) as response:
            answer = await response.json(content_type=None)
        return reported_count(answer["count"]) if self.python_server else len(answer["tokens"])

    async def exact_prompt_tokens(self, request: GenerateRequest) -> int | None:
        """A text prompt by the server's tokenizer; a chat first rendered by llama-server's
        `/apply-template` from the body its chat route gets (llama-cpp-python's server has no such route)."""
        if request.prompt_token_ids is not None:
            return len(request.prompt_token_ids)
        if request.prompt is not None:
            return await self._count(request.prompt)
        if self.python_server:
            return None
        async with await self._post("/apply-template", self._body(request)[1],
                                    timeout=aiohttp.ClientTimeout(total=30)) as response:
            if response.status != 200:
                raise self.error_for_status(response.status, await response.read())
            return await self._count((await response.json(content_type=None))["prompt"])

    async def count_prompt_tokens(self, request: GenerateRequest) -> int:
        """llama-cpp-python's server sends no usage in streams: a text prompt is counted exactly by
        its tokenizer (billing and quotas), a chat keeps the upper bound (its template is unknown here)."""
        if self.python_server and request.prompt is not None:
            try:
                return await self._count(request.prompt)
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                pass  # the bound below still reserves enough
        return await super().count_prompt_tokens(request)


def _gguf_chat_formatter(llama):
    """The formatter llama-cpp-python's `Llama` built for the chat template it chose from the GGUF
    (`chat_format` "chat_template.default" or "chat_template.<name>"), made again from the same
    template and special tokens; None where it chose a named format."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    name = (llama.chat_format or "").removeprefix("chat_template.")
    if name == llama.chat_format:
        return None
    template = llama.metadata.get("tokenizer.chat_template" + ("" if name == "default" else f".{name}"))
    if template is None:
        return None

    def text(token: int) -> str:
        return llama.detokenize([token], special=True).decode(errors="replace") if token != -1 else ""

    return Jinja2ChatFormatter(template, eos_token=text(llama.token_eos()), bos_token=text(llama.token_bos()),
                               stop_token_ids=[llama.token_eos()])


# OpenAI's ranges for request fields llama.cpp takes unchecked.
OPENAI_RANGES = {"presence_penalty": (-2, 2), "frequency_penalty": (-2, 2), "top_logprobs": (0, MAX_LOGPROBS),
                 "logprobs": (0, MAX_LOGPROBS), "n_probs": (0, MAX_LOGPROBS)}


def check_llamacpp_sampling(request: GenerateRequest) -> None:
    """llama.cpp does not check sampling ranges (llama-server runs a top_p of 1.5 as no cut, a
    presence penalty of 100 as given) nor cap log-probabilities (asked for 100,000, llama-server
    sends the whole vocabulary's with every token, megabytes each): its adapters refuse what
    OpenAI's API refuses."""
    check_sampling(request)
    for name, (low, high) in OPENAI_RANGES.items():
        value = request.extra.get(name)  # chat's `logprobs` is a switch (a bool), not a count
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not low <= value <= high:
            raise InvalidRequest(f"{name} must be in [{low}, {high}], got {value}", param=name)


@dataclass
class LlamaCppConfig:
    model: str = ""  # a GGUF file (default: the default model)
    served_name: str = ""
    slots: int = 2  # Llama instances, each serving one request at a time
    n_ctx: int = 2048  # per slot
    n_threads: int = 0  # per slot; 0: the machine's cores shared among the slots


@dataclass
class _Slot:
    """A `Llama` and the one thread that ever computes with it. llama.cpp parallelizes with OpenMP,
    whose worker team belongs to the calling thread: driven from a shared pool's threads, a slot
    grows a team per thread whose idle workers spin on the same cores and slow every token."""
    llama: Any
    thread: ThreadPoolExecutor


class LlamaCppBackend(Backend):
    """llama.cpp in process through llama-cpp-python: a pool of `Llama` instances, one per slot,
    each driven by its own thread (llama.cpp releases the GIL while it computes), so N requests
    run at once instead of queueing behind one lock. The weights are memory-mapped, so the
    instances share one copy in memory; each has its own KV cache and reuses the longest prefix
    it evaluated last (prefix caching per slot)."""

    def __init__(self, config: LlamaCppConfig | None = None, name: str = "llama-cpp") -> None:
        self.name, self.config = name, config or LlamaCppConfig()
        self._free: asyncio.Queue | None = None
        self._slots: list[_Slot] = []
        self._waiting = 0
        self._chat_formatter = None  # the GGUF's chat template, as llama-cpp-python renders it

    @property
    def path(self) -> Path:
        if self.config.model:
            return Path(self.config.model)
        from .default_model import default_model_path

        return default_model_path()

    @property
    def model_id(self) -> str:
        return self.config.served_name or self.path.stem

    async def start(self) -> None:
        llama_cpp_safe()
        from llama_cpp import Llama

        c = self.config
        threads = c.n_threads or max(1, (os.cpu_count() or 1) // c.slots)

        def load():
            return Llama(model_path=str(self.path), n_ctx=c.n_ctx, n_threads=threads, use_mmap=True, verbose=False)

        loop = asyncio.get_running_loop()
        for _ in range(c.slots):
            thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama-cpp-slot")
            self._slots.append(_Slot(await loop.run_in_executor(thread, load), thread))
        self._chat_formatter = _gguf_chat_formatter(self._slots[0].llama)
        self._free = asyncio.Queue()
        for slot in self._slots:
            self._free.put_nowait(slot)

    async def close(self) -> None:
        for slot in self._slots:
            slot.llama.close()
            slot.thread.shutdown(wait=False)
        self._slots = []

    async def load_adapter(self, adapter: Adapter) -> None:
        raise InvalidRequest(f"llama.cpp in process applies a LoRA adapter to the whole model when it loads it "
                             f"(llama-cpp-python's Llama(lora_path=...)): backend {self.name!r} loads none at run time",
                             param="model")

    def _check(self, request: GenerateRequest) -> None:
        if request.adapter is not None:
            raise ModelNotFound(f"backend {self.name!r} has no LoRA adapter {request.adapter!r}", param="model")
        if request.n != 1:
            raise InvalidRequest("llama.cpp slots generate one sequence per request: n must be 1", param="n")
        if request.prompt_token_ids is not None:
            raise InvalidRequest("send text or messages; token ids are not accepted here", param="prompt")
        check_llamacpp_sampling(request)
        self.admit_extras(request)  # whoever calls the engine directly gets the same refusal

    def _run(self, slot, request: GenerateRequest, emit, cancelled: threading.Event) -> None:
        """On the slot's thread: stream the completion, one chunk per token, into `emit`."""
        args = dict(max_tokens=request.max_tokens or 0, temperature=request.temperature, top_p=request.top_p,
                    top_k=request.top_k, seed=request.seed, stop=list(request.stop) or None, stream=True)
        try:
            if request.messages is not None:
                chunks = slot.create_chat_completion(messages=request.messages, **args)
            else:
                chunks = slot.create_completion(prompt=request.prompt, **args)
            for chunk in chunks:
                if cancelled.is_set():
                    chunks.close()  # stops llama.cpp at this token
                    break
                emit(chunk)
        except ValueError as exc:  # "Requested tokens (N) exceed context window of M"
            message = str(exc)
            kind = ContextTooLong if "context window" in message else InvalidRequest
            emit(kind(message, param="messages" if request.messages is not None else "prompt"))
        except Exception as exc:  # noqa: BLE001  (llama.cpp failures reach the caller, typed)
            emit(UpstreamError(f"llama.cpp: {exc}"))
        emit(None)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        if self._free is None:
            raise Unavailable("the model is still loading")
        self._check(request)
        if request.messages is not None:  # a GGUF's template reads strings only
            request = replace(request, messages=text_only(request.messages))
        self._waiting += 1
        try:
            slot = await self._free.get()
        finally:
            self._waiting -= 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        prompt_tokens = self._prompt_tokens(request) or 0
        worker = loop.run_in_executor(slot.thread, self._run, slot.llama, request,
                                      lambda item: loop.call_soon_threadsafe(queue.put_nowait, item), cancelled)
        worker.add_done_callback(lambda _: self._free.put_nowait(slot))  # free once its thread lets go
        texts, reason = [], None
        try:
            while (chunk := await queue.get()) is not None:
                if isinstance(chunk, BackendError):
                    raise chunk
                choice = chunk["choices"][0]
                text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                reason = choice.get("finish_reason") or reason
                if text or choice.get("finish_reason"):
                    texts.append(text or "")
                    yield Delta(0, text or "", (), choice.get("finish_reason"))
        finally:
            cancelled.set()  # the thread stops at its next token
        completion = sum(1 for t in texts if t)  # llama-cpp-python streams one token per chunk
        yield Finish((reason or "stop",), Usage(prompt_tokens, completion))

    async def capabilities(self) -> Capabilities:
        from llama_cpp import __version__

        return Capabilities(runtime="llama-cpp", version=__version__, model=self.model_id,
                            max_context=self.config.n_ctx, prefix_caching=True, tokenize=True)

    async def health(self) -> Health:
        return Health.READY if self._free is not None else Health.LOADING

    async def load(self) -> Load:
        busy = len(self._slots) - (self._free.qsize() if self._free else 0)
        return Load(running=busy, waiting=self._waiting, details={"slots": len(self._slots)})

    async def tokenize(self, text: str) -> list[TokenSpan]:
        if not self._slots:
            raise Unavailable("the model is still loading")
        llama = self._slots[0].llama  # the vocabulary is read-only: any slot can tokenize
        ids = llama.tokenize(text.encode(), add_bos=False)
        return spans(text, ids, [llama.detokenize([token]) for token in ids])

    def _prompt_tokens(self, request: GenerateRequest) -> int | None:
        """The prompt's tokens as llama-cpp-python makes them: a text with BOS where the model adds
        one; a chat as its handler for a GGUF's own template does (`llama_chat_format.
        chat_formatter_to_chat_completion_handler`, 0.3.36: the template rendered by
        `Jinja2ChatFormatter`, which adds the special tokens itself, then tokenized with special
        tokens parsed). None for a chat in one of its named formats, whose formatters it keeps."""
        llama = self._slots[0].llama  # the vocabulary is read-only: any slot counts
        if request.prompt is not None:
            return len(llama.tokenize(request.prompt.encode(), add_bos=True))
        if request.messages is None or self._chat_formatter is None:
            return None
        rendered = self._chat_formatter(messages=text_only(request.messages))
        return len(llama.tokenize(rendered.prompt.encode(), add_bos=not rendered.added_special, special=True))

    async def count_prompt_tokens(self, request: GenerateRequest) -> int:
        count = await asyncio.to_thread(self._prompt_tokens, request) if self._slots else None
        return count if count is not None else await super().count_prompt_tokens(request)
