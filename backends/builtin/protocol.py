"""What crosses between the API process and the engine core, typed: the commands the API process
sends (`AddRequest`, `LoadAdapter`, `UnloadAdapter`, `Abort`, `Stop`) and the messages the core
answers with (`Ready` or `LoadFailed` once, then `Outputs`, `Failed`, `Refused` and `Done`), each a
msgspec Struct in a tagged union, encoded as MessagePack over the pipe. Modelled on vLLM v1's `EngineCoreRequest` and
`EngineCoreOutputs`; the engine thread of the thread mode passes the same objects unencoded.
"""

from __future__ import annotations

import msgspec

from backends.constraints import Constraint


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 16
    temperature: float = 1.0  # below 1e-5 means greedy, as in vLLM
    top_p: float = 1.0
    top_k: int = 0  # 0 means no cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely
    grammar: Constraint | None = None  # structured output
    # False where the output's reader needs the markers a tokenizer holds as special tokens (a
    # family's tool-call and channel markers); vLLM's field of the same name.
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class Logprob(msgspec.Struct, frozen=True):
    """The chosen token's log-probability and the most likely alternatives, from the model's raw
    distribution (vLLM's default `raw_logprobs`: before masks, penalties and temperature)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


class StepOutput(msgspec.Struct, frozen=True):
    """One choice's new token of a step, with the text it released."""

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served to this choice
    logprobs: tuple[Logprob, ...] = ()  # one per token, where the request asked for them
    embedding: list[float] | None = None  # an embedding request's vector, with its finish (and no tokens)


class CoreInfo(msgspec.Struct, frozen=True):
    """What the API process needs to know of the engine it cannot see."""

    max_model_len: int
    num_blocks: int
    block_size: int
    dtype: str
    dtype_reason: str
    vocab_size: int
    weights: str  # what the weights are stored as: "Q4_1 x210, Q8_0 x1"
    weight_bytes_per_token: int  # weights a token's forward reads


Stats = dict[str, int | float]  # the engine's figures at a step boundary (`LLMEngine.stats`)


# -- commands: API process -> core --------------------------------------------------------
class AddRequest(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    cache_salt: str | None = None
    adapter: str | None = None  # a LoRA adapter's name, loaded by `LoadAdapter`
    # An embedding request (vLLM v1's `pooling_params`): its prompt is computed, then pooled into one
    # vector instead of sampled from (`params` keep their defaults: one choice).
    embed: bool = False
    tenant: str | None = None  # whose request: the scheduler takes tenants' waiting requests in turn


class LoadAdapter(msgspec.Struct, frozen=True, tag=True):
    """Make a LoRA adapter servable by name (its weights read into host memory); answered `Done`.
    `path`: the factors file the API process wrote from the adapter's files, read in a sandbox."""

    command_id: str
    name: str
    path: str


class UnloadAdapter(msgspec.Struct, frozen=True, tag=True):
    """Take an adapter's name away; requests running with it finish first. Answered `Done`."""

    command_id: str
    name: str


class Abort(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class Stop(msgspec.Struct, frozen=True, tag=True):
    pass


Command = AddRequest | LoadAdapter | UnloadAdapter | Abort | Stop


# -- messages: core -> API process --------------------------------------------------------
class Ready(msgspec.Struct, frozen=True, tag=True):
    info: CoreInfo
    stats: Stats


class LoadFailed(msgspec.Struct, frozen=True, tag=True):
    why: str


class Outputs(msgspec.Struct, frozen=True, tag=True):
    """A step's outputs (none where the core fell idle, after an abort), and the figures after it."""

    outputs: list[StepOutput]
    stats: Stats
    resident_adapters: tuple[str, ...] = ()  # LoRA adapters in compute slots after the step


class Failed(msgspec.Struct, frozen=True, tag=True):
    """A step raised: its requests were aborted."""

    request_ids: list[str]
    why: str
    stats: Stats


class Refused(msgspec.Struct, frozen=True, tag=True):
    """A request the engine would not take (a duplicate id, a grammar that does not compile)."""

    request_id: str
    why: str


class Done(msgspec.Struct, frozen=True, tag=True):
    """A command other than a request carried out, or why it could not be."""

    command_id: str
    why: str | None = None


CoreMessage = Ready | LoadFailed | Outputs | Failed | Refused | Done

_encoder = msgspec.msgpack.Encoder()
_commands = msgspec.msgpack.Decoder(Command)
_messages = msgspec.msgpack.Decoder(CoreMessage)


def encode(item: Command | CoreMessage) -> bytes:
    return _encoder.encode(item)


def decode_command(data: bytes) -> Command:
    return _commands.decode(data)


def decode_message(data: bytes) -> CoreMessage:
    return _messages.decode(data)
