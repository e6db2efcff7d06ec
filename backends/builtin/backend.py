"""The built-in engine behind the Backend interface: validation, chat templates, events."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from backends import fields, sandbox
from backends.base import (
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
    Tokenized,
    TokenSpan,
    Unavailable,
    Usage,
    check_sampling,
    prompt_text_bytes,
    servegate_version,
    text_only,
)
from backends.builtin import logprobs, tools
from backends.builtin.chat_formats import PROMPT_TAIL_TOKENS, ChatFormat
from backends.builtin.config import EngineConfig
from backends.builtin.core.engine import LLMEngine, check_request
from backends.builtin.core.structured import check
from backends.builtin.front import EngineFront, EngineProcess, EngineThread
from backends.builtin.protocol import CoreInfo, LoadAdapter, SamplingParams, UnloadAdapter
from backends.builtin.tools import ToolUse
from backends.builtin.worker.loader import default_model_path, load_tokenizer, model_dir, model_name, read_model_config
from backends.builtin.worker.lora import NO_LORA, prepare_adapter
from backends.builtin.worker.models.config import ModelConfig
from backends.constraints import constraint_of

log = logging.getLogger("servegate.builtin")

MAX_N = 16
SUPERVISE_S = 0.5  # how often the engine core's life is checked
RESTART_WINDOW_S, MAX_RESTARTS = 60.0, 3  # a core that dies more often than this is left down
ADAPTER_READ_TIMEOUT_S = 120.0
ADAPTER_READ_MEMORY_BYTES = 8 << 30  # beyond the reader's own start: a few copies of a large adapter
REFUSALS_KEPT = 1024  # adapters (by their files' digest) whose refusal is answered without reading them again
REASONING_EFFORTS = ("low", "medium", "high")  # gpt-oss's, which vLLM takes
TOKENIZER_THREADS = 2  # templating and tokenizing run here, off the event loop; more requests wait their turn


class BuiltinBackend(Backend):
    """servegate's own paged, prefix-caching, continuously batching engine, in process."""

    EXTRA_FIELDS = fields.BUILTIN

    @property
    def extra_fields(self) -> frozenset[str]:
        """`reasoning_effort` where the model's template reads it: a model that does not reason is refused it."""
        reads_effort = self.chat_format is not None and self.chat_format.reads_reasoning_effort
        return self.EXTRA_FIELDS | {"reasoning_effort"} if reads_effort else self.EXTRA_FIELDS

    def __init__(self, config: EngineConfig | None = None, name: str = "builtin") -> None:
        self.name = name
        self.config = config or EngineConfig()
        self.engine: LLMEngine | None = None  # in this process (a thread steps it), else None
        self._front: EngineFront | None = None
        self.info: CoreInfo | None = None
        self.tokenizer = None
        self.chat_format: ChatFormat | None = None  # the tool and reasoning formats of the model's chat template
        self._texts: logprobs.TokenTexts | None = None  # every token's bytes (logprobs, the longest token)
        self._load_error: BaseException | None = None
        # Prompt ids counted for a quota reservation, kept for the request's generate(): a prompt
        # is templated and tokenized once. Bounded: a request refused after counting never comes.
        self._tokenizing = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix=f"{name}-tokenize")
        self._longest_token = 1  # bytes: what `min_prompt_tokens` divides a prompt's bytes by
        self.adapters: dict[str, str] = self.config.adapters()  # LoRA adapters served: name -> path
        self.model_config: ModelConfig | None = None  # what adapters are checked against
        # Adapters loaded at run time, with the factors file each was read into (a restarted core reloads them).
        self._loaded: dict[str, tuple[Adapter, Path]] = {}
        self._refused: dict[Adapter, str] = {}  # why adapters failed to read, oldest first
        self._factors_dir: Path | None = None  # made at the first load
        self._supervisor: asyncio.Task | None = None

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        try:
            if self.config.engine_process:
                directory = await asyncio.to_thread(model_dir, self.config.model or None, self.config.cache_dir,
                                                    self.config.gguf_weights == "quantized")
                self.tokenizer = await asyncio.to_thread(load_tokenizer, directory)
                self.model_config = await asyncio.to_thread(read_model_config, directory)
                front = await asyncio.to_thread(EngineProcess, self.config)
                self.info = front.info
            else:
                self.engine = await asyncio.to_thread(LLMEngine, self.config)
                front, self.info, self.tokenizer = EngineThread(self.engine), self.engine.core_info(), \
                    self.engine.tokenizer
                self.model_config = self.engine.loaded.config
            self._texts = await asyncio.to_thread(logprobs.TokenTexts, self.tokenizer)
            self.chat_format = ChatFormat.of(self.tokenizer)
        except BaseException as exc:
            self._load_error = exc
            raise
        self._longest_token = max(map(len, self._texts.bytes), default=1) or 1
        self._front = front
        if self.config.engine_process:
            self._supervisor = asyncio.create_task(self._supervise(), name=f"{self.name}-supervisor")
        info = self.info
        log.info("model %s loaded: %s (%s), weights %s (%.1f MB read per token), max context %d, %d KV blocks of "
                 "%d tokens, engine %s", self.model_id, info.dtype, info.dtype_reason, info.weights,
                 info.weight_bytes_per_token / 1e6, info.max_model_len, info.num_blocks, info.block_size,
                 "in its own process" if self.config.engine_process else "on a thread")

    @property
    def dtype(self) -> str | None:
        """The dtype the engine runs in (what `auto` chose), once loaded."""
        return self.info.dtype if self.info else None

    async def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
        if self._front is not None:
            self._front.shutdown()
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        if self._factors_dir is not None:
            shutil.rmtree(self._factors_dir, ignore_errors=True)

    async def _supervise(self) -> None:
        """Restart the engine core when it dies: its open streams have failed with a retryable
        error, and until a new core is ready the backend is restarting (`Unavailable`); the new one
        serves the adapters the old one had loaded. A core that keeps dying (more than `MAX_RESTARTS`
        within `RESTART_WINDOW_S`) is left down."""
        restarts: list[float] = []
        while True:
            await asyncio.sleep(SUPERVISE_S)
            if self._front is not None:
                if self._front.alive:
                    continue
                log.error("%s: the engine core exited (%s); restarting it", self.name, self._front.exit_reason)
                dead, self._front = self._front, None
                await asyncio.to_thread(dead.shutdown)
            started = time.monotonic()
            restarts = [t for t in restarts if started - t < RESTART_WINDOW_S] + [started]
            if len(restarts) > MAX_RESTARTS:
                self._load_error = RuntimeError(f"the engine core exited {MAX_RESTARTS} times within "
                                                f"{RESTART_WINDOW_S:g} s; it is left down")
                log.error("%s: %s", self.name, self._load_error)
                return
            try:
                front = await asyncio.to_thread(EngineProcess, self.config)
            except Exception as exc:  # tried again at the next round, within the bound
                log.error("%s: the engine core did not restart: %s", self.name, exc)
                continue
            for name, (_, factors) in list(self._loaded.items()):
                try:
                    await front.command(LoadAdapter(f"load-{uuid.uuid4().hex}", name, str(factors)))
                except BackendError as exc:
                    log.error("%s: the adapter %r was not reloaded: %s", self.name, name, exc.message)
                    del self._loaded[name], self.adapters[name]
            self._front = front
            log.info("%s: the engine core restarted in %.1f s, with %d adapters loaded at run time", self.name,
                     time.monotonic() - started, len(self._loaded))

    async def _off_loop(self, work, *args):
        """Work that grows with the input (templating, tokenizing), on the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, work, *args)

    @property
    def model_id(self) -> str:
        source = Path(self.config.model) if self.config.model else default_model_path()
        return self.config.served_name or model_name(source)

    def _ready(self) -> tuple[CoreInfo, EngineFront]:
        if self._load_error is not None:
            raise Unavailable(f"the model failed to load: {self._load_error}")
        if self._front is None:
            raise Unavailable("the model is loading" if self.info is None else "the engine core is restarting")
        return self.info, self._front

    # -- generation ---------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        info, front = self._ready()
        if request.adapter is not None and request.adapter not in self.adapters:
            raise ModelNotFound(f"the LoRA adapter {request.adapter!r} is not loaded", param="model")
        tokenized = request.tokenized
        prompt_ids = list(tokenized.ids) if tokenized and tokenized.backend == self.name else await self._off_loop(
            self._prompt_ids, info, request)
        tool_use = ToolUse.of(request.extra)
        prompt_tail = self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]) if request.messages else ""
        params = self._sampling_params(info, request, len(prompt_ids), tool_use, prompt_tail)
        reasons: list[str | None] = [None] * params.n
        offsets = [0] * params.n  # characters of each choice's text so far (completions' text_offset)
        reads_output = request.messages is not None or tool_use is not None
        parsers = [self.chat_format.parser(tool_use is not None, prompt_tail) if reads_output else None
                   for _ in range(params.n)]
        echo = self._echo(request, prompt_ids)
        unechoed = set(range(params.n)) if echo else set()
        completion_tokens = cached = 0
        async for out in front.stream(request.request_id, prompt_ids, params, request.stop, request.cache_salt,
                                      request.adapter, tenant=request.tenant):
            completion_tokens += len(out.token_ids)
            cached = max(cached, out.num_cached_tokens)
            text, reason, extra = out.text, out.finish_reason, {}
            if out.index in unechoed:  # with each choice's first piece: an engine error still comes first
                text = echo + text
                unechoed.discard(out.index)
            if out.logprobs and request.messages:
                extra["logprobs"] = logprobs.chat(self._texts, out.token_ids, out.logprobs)
            elif out.logprobs:
                extra["logprobs"] = logprobs.completion(self._texts, out.token_ids, out.logprobs,
                                                        offsets[out.index])
                offsets[out.index] += sum(map(len, extra["logprobs"]["tokens"]))
            parser = parsers[out.index]
            if parser:
                text, fields = parser.feed(text, final=reason is not None)
                if fields:
                    extra["delta"] = fields
                if reason == "stop" and parser.calls:
                    reason = "tool_calls"
            if reason:
                reasons[out.index] = reason
            yield Delta(out.index, text, out.token_ids, reason, extra or None)
        yield Finish(tuple(reasons), Usage(len(prompt_ids), completion_tokens, cached))

    def _echo(self, request: GenerateRequest, prompt_ids: list[int]) -> str:
        """Completions' `echo`: the prompt before each choice's text (prompt logprobs are not
        computed: the model's logits are taken only where a token is sampled)."""
        if not request.extra.get("echo"):
            return ""
        if request.messages is not None:
            raise InvalidRequest("echo is a completions parameter", param="echo")
        if request.extra.get("logprobs") is not None:
            raise InvalidRequest("echo with logprobs (the prompt's logprobs) is not supported", param="echo")
        return request.prompt if request.prompt is not None else self.tokenizer.decode(prompt_ids)

    def _prompt_ids(self, info: CoreInfo, request: GenerateRequest) -> list[int]:
        tokenizer = self.tokenizer
        if request.prompt_token_ids is not None:
            return _in_vocabulary(request.prompt_token_ids, info.vocab_size, "prompt")
        if request.prompt is not None:
            return tokenizer.encode(request.prompt)
        request = self.admit_extras(request)  # nothing unchecked reaches the template
        messages, template_fields = tools.render(text_only(request.messages), ToolUse.of(request.extra),
                                                 self.chat_format)
        template_fields |= _template_switches(request.extra)
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                 **template_fields)
        except Exception as exc:  # jinja raises on messages the template cannot render
            raise InvalidRequest(f"the chat template cannot render these messages: {exc}", param="messages") from exc
        return tokenizer.encode(text, add_special_tokens=False)  # the template holds any special tokens

    def _sampling_params(self, info: CoreInfo, request: GenerateRequest, num_prompt_tokens: int,
                         tool_use: ToolUse | None, prompt_tail: str) -> SamplingParams:
        request = self.admit_extras(request)  # whoever calls the engine directly gets the same refusal
        check_sampling(request)
        if not 1 <= request.n <= MAX_N:
            raise InvalidRequest(f"n must be between 1 and {MAX_N}", param="n")
        if request.n > 1 and request.temperature < 1e-5:
            raise InvalidRequest("n > 1 needs sampling (temperature >= 1e-5): greedy choices would be identical",
                                 param="n")
        try:
            max_tokens = check_request(info.max_model_len, num_prompt_tokens, request.max_tokens)
        except OverflowError as exc:
            raise ContextTooLong(str(exc), param="messages" if request.messages else "prompt") from exc
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="prompt") from exc
        extra = request.extra
        min_tokens = _number(extra, "min_tokens", int, 0, 0, max_tokens)
        return SamplingParams(
            max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
            top_k=request.top_k, seed=request.seed, stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos, n=request.n, min_p=_number(extra, "min_p", float, 0.0, 0.0, 1.0),
            min_tokens=min_tokens, presence_penalty=_number(extra, "presence_penalty", float, 0.0, -2.0, 2.0),
            frequency_penalty=_number(extra, "frequency_penalty", float, 0.0, -2.0, 2.0),
            repetition_penalty=_number(extra, "repetition_penalty", float, 1.0, 1e-6, 100.0),
            logit_bias=_logit_bias(extra.get("logit_bias"), info.vocab_size),
            logprobs=_logprobs(request), grammar=self._grammar(request, tool_use, prompt_tail),
            skip_special_tokens=not (request.messages is not None
                                     and self.chat_format.keeps_special_tokens(tool_use is not None)),
        )

    def _grammar(self, request: GenerateRequest, tool_use: ToolUse | None, prompt_tail: str):
        """The output's constraint: the tool choice's grammar in the model's format, or the
        structured output asked for (a chat's JSON one placed where the format puts the answer)."""
        constraint = constraint_of(request.extra)
        if tool_use and constraint:
            raise InvalidRequest("tools and a structured output cannot constrain one answer together", param="tools")
        if tool_use:
            constraint = self.chat_format.tool_constraint(tool_use, prompt_tail)
        if constraint is None:
            return None
        try:
            check(constraint)
        except ValueError as exc:
            raise InvalidRequest(f"{constraint.source}: {exc}", param=constraint.source) from exc
        return self.chat_format.answer_constraint(constraint, prompt_tail) if request.messages is not None \
            else constraint

    # -- embeddings ---------------------------------------------------------------------
    async def embed(self, request: EmbedRequest) -> Embeddings:
        """Each input an embedding request of its own, all in the engine at once, where steps batch
        them with generation; the base model's vectors, whatever LoRA adapters the engine serves."""
        info, front = self._ready()
        if request.dimensions is not None:
            # vLLM's rule (`vllm/pooling_params.py`): only a model trained for Matryoshka embeddings
            # (`is_matryoshka` or `matryoshka_dimensions` in its config) may be cut short; the Llama
            # models this engine runs are generative, and it reads no such marker.
            raise InvalidRequest(f"Model {self.model_id!r} does not support Matryoshka embeddings; dimensions must be "
                                 f"unset (received dimensions={request.dimensions}).", param="dimensions")
        prompts = await self._off_loop(self._embed_ids, info, request.inputs)
        tasks = [asyncio.ensure_future(front.embed(f"{request.request_id}-{i}", ids, request.cache_salt,
                                                   request.tenant)) for i, ids in enumerate(prompts)]
        try:
            vectors = await asyncio.gather(*tasks)
        finally:  # one failed, or the caller left: the others end too, aborting their requests
            for task in tasks:
                task.cancel()
        return Embeddings(list(vectors), sum(map(len, prompts)))

    def _embed_ids(self, info: CoreInfo, inputs: tuple[str | tuple[int, ...], ...]) -> list[list[int]]:
        """Each input's ids, as vLLM's embeddings route makes them (a text with its special tokens),
        each of at most the context's tokens (a prompt for no output)."""
        prompts = []
        for i, item in enumerate(inputs):
            ids = self.tokenizer.encode(item) if isinstance(item, str) else _in_vocabulary(item, info.vocab_size,
                                                                                            "input")
            if not ids:
                raise InvalidRequest(f"input {i} is empty", param="input")
            if len(ids) > info.max_model_len:
                raise ContextTooLong(f"This model's maximum context length is {info.max_model_len} tokens. However, "
                                     f"input {i} contains {len(ids)} tokens, which exceeds this limit even without "
                                     "any output tokens. Please reduce the length of the input.", param="input")
            prompts.append(ids)
        return prompts

    # -- introspection ------------------------------------------------------------------
    async def capabilities(self) -> Capabilities:
        return Capabilities(
            runtime="builtin", version=servegate_version(), model=self.model_id,
            max_context=self.info.max_model_len if self.info else 0,
            prefix_caching=self.config.enable_prefix_caching,
            dtype=self.dtype,
            kv_dtype=self.dtype if self.config.kv_cache_dtype == "auto" else self.config.kv_cache_dtype,
            weights=self.info.weights if self.info else None,
            weight_bytes_per_token=self.info.weight_bytes_per_token if self.info else None,
            tokenize=True,
            structured_output=True,
            features=frozenset({"n", "seed", "stop", "stop_token_ids", "ignore_eos", "top_k", "min_p", "min_tokens",
                                "penalties", "logit_bias", "logprobs"}),
            max_loras=self.config.max_loras if self.config.enable_lora else 0,
            max_lora_rank=self.config.max_lora_rank if self.config.enable_lora else 0,
            adapters=frozenset(self.adapters),
            embeddings=True,
        )

    async def health(self) -> Health:
        if self._load_error is not None:
            return Health.DOWN
        if self._front is None:
            return Health.LOADING
        return Health.READY if self._front.alive else Health.DOWN

    async def load(self) -> Load:
        if self._front is None:
            return Load()
        stats = self._front.stats
        queries = stats["prefix_cache_queries_total"]
        return Load(
            running=stats["running"], waiting=stats["waiting"],
            kv_usage=stats["kv_blocks_used"] / stats["kv_blocks_total"],
            prefix_hit_rate=stats["prefix_cache_hits_total"] / queries if queries else None, details=stats,
            resident_adapters=frozenset(self._front.resident_adapters),
        )

    # -- LoRA adapters ------------------------------------------------------------------
    async def load_adapter(self, adapter: Adapter) -> None:
        """The adapter's files are read and checked against the model in a sandbox, bounded in time
        and memory (their stored copy verified against its digest first), and written as a factors
        file; the engine core loads that into host memory at its next step boundary, and the adapter
        enters a compute slot when a step first runs it. InvalidRequest naming what is wrong."""
        _, front = self._ready()
        if self._loaded.get(adapter.name, (None,))[0] == adapter:
            return
        if not self.config.enable_lora:
            raise InvalidRequest(NO_LORA, param="model")
        if (refusal := self._refused.get(adapter)) is not None and adapter.digest is not None:
            raise InvalidRequest(refusal, param="model")  # the same bytes fail the same way: not read again
        self._factors_dir = self._factors_dir or Path(tempfile.mkdtemp(prefix=f"servegate-{self.name}-lora-"))
        factors = self._factors_dir / f"{uuid.uuid4().hex}.safetensors"
        try:
            await asyncio.to_thread(sandbox.run, prepare_adapter, (adapter.path, adapter.digest, self.model_config,
                                    self.config.max_lora_rank, str(factors)), what="reading the adapter",
                                    timeout_s=ADAPTER_READ_TIMEOUT_S, memory_bytes=ADAPTER_READ_MEMORY_BYTES)
        except ValueError as exc:
            refusal = f"the LoRA adapter {adapter.name!r} cannot be served: {exc}"
            if not isinstance(exc, sandbox.TimedOut):
                self._refused[adapter] = refusal
                while len(self._refused) > REFUSALS_KEPT:
                    del self._refused[next(iter(self._refused))]
            raise InvalidRequest(refusal, param="model") from None
        await front.command(LoadAdapter(f"load-{uuid.uuid4().hex}", adapter.name, str(factors)))
        self.adapters[adapter.name] = adapter.path
        self._loaded[adapter.name] = (adapter, factors)

    async def unload_adapter(self, name: str) -> None:
        _, front = self._ready()
        if name not in self.adapters:
            raise ModelNotFound(f"backend {self.name!r} has no adapter {name!r}", param="model")
        await front.command(UnloadAdapter(f"unload-{uuid.uuid4().hex}", name))
        del self.adapters[name]
        if (loaded := self._loaded.pop(name, None)) is not None:
            loaded[1].unlink(missing_ok=True)

    async def count_prompt_tokens(self, request: GenerateRequest) -> int:
        return len((await self.tokenize_prompt(request)).ids)

    async def tokenize_prompt(self, request: GenerateRequest) -> Tokenized:
        info, _ = self._ready()
        return Tokenized(self.name, tuple(await self._off_loop(self._prompt_ids, info, request)))

    def min_prompt_tokens(self, request: GenerateRequest) -> int:
        """No token of this vocabulary spans more than its longest token's bytes."""
        return super().min_prompt_tokens(request) or -(-prompt_text_bytes(request) // self._longest_token)

    async def tokenize(self, text: str) -> list[TokenSpan]:
        self._ready()
        return await self._off_loop(self._spans, text)

    def _spans(self, text: str) -> list[TokenSpan]:
        encoded = self.tokenizer(text, return_offsets_mapping=True)
        return [TokenSpan(i, text[a:b], a, b) for i, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"])]


def _in_vocabulary(ids, vocab_size: int, param: str) -> list[int]:
    """Token ids a client sent, each inside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param=param)
    return list(ids)


def _number(extra: dict, name: str, kind: type, default, low, high):
    """A numeric knob from the request's extras, checked against its range."""
    value = extra.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise InvalidRequest(f"{name} must be {'an integer' if kind is int else 'a number'}", param=name)
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be between {low} and {high}, got {value}", param=name)
    return kind(value)


def _logit_bias(value, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]}, every id inside the vocabulary."""
    if not value:
        return ()
    if not isinstance(value, dict):
        raise InvalidRequest("logit_bias must map token ids to biases", param="logit_bias")
    bias = []
    for key, amount in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})",
                                 param="logit_bias")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not -100 <= amount <= 100:
            raise InvalidRequest(f"logit_bias for token {token} must be a number in [-100, 100]", param="logit_bias")
        bias.append((token, float(amount)))
    return tuple(bias)


def _logprobs(request: GenerateRequest) -> int | None:
    """How many alternatives each token's logprobs list: chat's `logprobs: true` with
    `top_logprobs`, or completions' `logprobs: k`; None where not asked."""
    extra = request.extra
    logprobs, top = extra.get("logprobs"), extra.get("top_logprobs")
    if request.messages is not None:
        if top is not None and not logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        if not logprobs:
            return None
        if logprobs is not True:
            raise InvalidRequest("logprobs must be true or false in chat completions", param="logprobs")
        value, name = (0 if top is None else top), "top_logprobs"
    else:
        if logprobs is None or logprobs is False:
            return None
        value, name = logprobs, "logprobs"
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequest(f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {value!r}", param=name)
    return value


def _template_switches(extra: dict) -> dict:
    """The template arguments a request sets: its `chat_template_kwargs` (checked by `admit_extras`)
    and gpt-oss's `reasoning_effort`."""
    switches = dict(extra.get("chat_template_kwargs") or {})
    effort = extra.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise InvalidRequest(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                                 param="reasoning_effort")
        switches["reasoning_effort"] = effort
    return switches
