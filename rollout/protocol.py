"""The HTTP server's wire format, as pydantic models: OpenAI's `/v1/completions`, `/v1/chat/completions` and
`/v1/models` (with vLLM's token-id extensions and this engine's), SGLang's native `/generate` and control
endpoints, and OpenAI's error shape.

Every request model refuses unknown fields, and checks types strictly (`"temperature": "0.5"` is refused,
not converted; NaN and infinities are refused; token ids are non-negative ints). `describe(error, model)`
turns a pydantic `ValidationError` into one message that names the field and its rule
(`temperature must be a finite number >= 0, got 'hot'`) plus the OpenAI `param`. What depends on the served
engine or the server's limits (the vocabulary, max_model_len, max_n, the cache-salt bound) is checked by
rollout/server.py, which also builds the responses from these models.

Not here: sampling itself (rollout/sampling_params.py checks its own fields again), chat templates
(rollout/chat.py), tool-call parsing (rollout/tool_parsers.py).
"""

from __future__ import annotations

import time
import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

# ---- field types: each description is the rule an error message quotes ------------------------------------
MAX_LOGPROBS = 20
"""Most top logprobs per position a request may ask for (OpenAI's bound)."""

TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Temperature = Annotated[float, Field(ge=0, description="a finite number >= 0")]
TopP = Annotated[float, Field(gt=0, le=1, description="a number in (0, 1]")]
TopK = Annotated[int, Field(ge=-1, description="an integer >= -1 (0 or -1: no top-k)")]
MinP = Annotated[float, Field(ge=0, le=1, description="a number in [0, 1]")]
NumSamples = Annotated[int, Field(ge=1, description="an integer >= 1")]
MaxTokens = Annotated[int, Field(ge=1, description="an integer >= 1")]
MinTokens = Annotated[int, Field(ge=0, description="an integer >= 0")]
Seed = Annotated[int, Field(ge=-(1 << 63), lt=1 << 64, description="an integer in [-2**63, 2**64)")]
Stop = Annotated[Union[str, list[Annotated[str, Field(min_length=1)]]],
                 Field(description="a non-empty string or a list of non-empty strings")]
StopTokenIds = Annotated[list[TokenId], Field(description="a list of token ids (integers >= 0)")]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS, description=f"an integer in [0, {MAX_LOGPROBS}]")]
CacheSalt = Annotated[str, Field(min_length=1, description="a non-empty string")]


def Nullable(t):  # noqa: N802 (a type)
    """`t | None` that keeps the rule (description) of the Annotated type `t`, which a plain `t | None` loses."""
    rule = next(m.description for m in typing.get_args(t)[1:] if isinstance(m, FieldInfo) and m.description)
    return Annotated[Union[t, None], Field(description=rule)]


class _Strict(BaseModel):
    """Unknown fields refused, types checked strictly, NaN / Inf refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    """Send a last chunk with the request's usage (and no choices) before `data: [DONE]`."""


class _SamplingFields(_Strict):
    """The sampling fields /v1/completions and /v1/chat/completions share (OpenAI's and vLLM's names)."""

    model: str | None = Field(default=None, description="the served model's id or a loaded LoRA adapter's name "
                                                        "(see /v1/models)")
    n: NumSamples = 1
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    seed: Nullable(Seed) = None
    stop: Nullable(Stop) = None
    stop_token_ids: Nullable(StopTokenIds) = None
    ignore_eos: bool = False
    min_tokens: MinTokens = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """OpenAI's end-user id; accepted and ignored."""
    return_token_ids: bool = False
    """vLLM's: the prompt's token ids and each choice's token ids in the response."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprob tokens spelled "token_id:N" instead of their text."""
    prompt_logprobs: Nullable(NumLogprobs) = None
    """vLLM's: the logprob of every prompt token (after the first) under the model, and the top-N."""
    cache_salt: Nullable(CacheSalt) = None
    """vLLM's: requests with different salts never share prefix-cache blocks."""
    return_routed_experts: bool = False
    """This engine's (MoE routing replay): each choice's `routed_experts`, base64 of the little-endian int32
    array [P + L - 1, num_moe_layers, top_k] of the experts chosen at every input position (the prompt and
    every completion token but the last), with its `routed_experts_shape`; streamed, in the choice's last chunk."""

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self


PromptField = Annotated[
    Union[str, Annotated[list[str], Field(min_length=1)], TokenIds, Annotated[list[TokenIds], Field(min_length=1)]],
    Field(description="a string, a list of strings, a list of token ids (integers >= 0), or a list of such lists "
                      "(no list empty)"),
]


PromptEmbedsField = Annotated[
    Union[str, Annotated[list[str], Field(min_length=1)]],
    Field(description="base64 of a safetensors blob holding one tensor [T, hidden_size], or a non-empty list of such "
                      "strings"),
]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Nullable(PromptField) = None
    """Required unless `prompt_embeds` is given (then it must be left out or "", as vLLM's clients send it)."""
    prompt_embeds: Nullable(PromptEmbedsField) = None
    """vLLM's: the prompt(s) as input-embedding rows (rollout/prompt_embeds.py), each the base64 of a safetensors
    blob with one floating-point tensor [T, hidden_size] (vLLM takes `torch.save` output; this server never
    unpickles, so it takes safetensors)."""
    max_tokens: Annotated[int, Field(ge=0, description="an integer >= 0 (0 only with echo)")] = 16
    echo: bool = False
    """Put the prompt before each completion (its text, and with `logprobs` its tokens' logprobs)."""
    logprobs: Nullable(NumLogprobs) = None
    """Return each completion token's logprob, and the N most likely tokens at each position."""
    add_special_tokens: bool = True
    """Tokenize text prompts with the special tokens the tokenizer's post-processor adds (BOS)."""

    @model_validator(mode="after")
    def _zero_tokens_only_to_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing; it is only allowed with echo: true (to score a prompt)")
        return self


class TextPart(_Strict):
    type: Literal["text"] = Field(description='"text" (the only content part this server reads)')
    text: str


class FunctionCallIn(_Strict):
    name: str
    arguments: str = Field(description="the call's arguments, a JSON string")


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description='one of "system", "developer", "user", "assistant", "tool"')
    content: Union[str, list[TextPart], None] = Field(
        default=None, description="a string, a list of text parts, or null")
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, description="a non-empty string")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = Field(description='"function"')
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = Field(
        default=None, description='"auto" or "none" ("required" and a named tool are not supported)')
    """"auto" (the default when tools are given): tool calls in the completion are parsed into `tool_calls`;
    "none": the completion is returned as content."""
    parallel_tool_calls: bool | None = None
    """Accepted; every tool call the parser finds is returned."""
    max_tokens: Nullable(MaxTokens) = None
    max_completion_tokens: Nullable(MaxTokens) = None
    """OpenAI's newer name of max_tokens (wins when both are given). Neither: up to max_model_len."""
    logprobs: bool = False
    top_logprobs: Nullable(NumLogprobs) = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. {"enable_thinking": false})."""

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


# ---- SGLang's native API -----------------------------------------------------------------------------------
class SGLangSamplingParams(_Strict):
    """`sampling_params` of SGLang's /generate (its names)."""

    max_new_tokens: MaxTokens = 128
    min_new_tokens: MinTokens = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    n: NumSamples = 1
    stop: Nullable(Stop) = None
    stop_token_ids: Nullable(StopTokenIds) = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    """Keep a matched stop string at the end of the text."""
    sampling_seed: Nullable(Seed) = None
    seed: Nullable(Seed) = None
    """Another name of sampling_seed."""
    custom_params: dict[str, Any] | None = None
    """SGLang's arguments of a custom logit processor; taken and ignored (none runs here), as slime sends
    `{"return_top_p_token_ids": true}` whenever top_p < 1."""

    @model_validator(mode="after")
    def _one_seed(self):
        if self.sampling_seed is not None and self.seed is not None:
            raise ValueError("sampling_params: give sampling_seed or seed, not both")
        return self


class GenerateRequest(_Strict):
    """POST /generate (SGLang): one prompt or a batch, as text or token ids."""

    text: Union[str, Annotated[list[str], Field(min_length=1)], None] = Field(
        default=None, description="a string or a non-empty list of strings")
    input_ids: Union[TokenIds, Annotated[list[TokenIds], Field(min_length=1)], None] = Field(
        default=None, description="a list of token ids (integers >= 0) or a non-empty list of such lists")
    input_embeds: Union[Annotated[list[list[float]], Field(min_length=1)],
                        Annotated[list[Annotated[list[list[float]], Field(min_length=1)]], Field(min_length=1)],
                        None] = Field(
        default=None, description="a prompt's input-embedding rows [T][hidden_size] (finite numbers), or a non-empty "
                                  "list of such prompts")
    """SGLang's: the prompt(s) as input-embedding rows, JSON numbers (cast to the model's dtype), instead of text or
    token ids."""
    sampling_params: SGLangSamplingParams | None = None
    return_logprob: bool = False
    top_logprobs_num: NumLogprobs = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: Union[str, list[str], None] = Field(default=None, description="a string, or a list of one per prompt")
    cache_salt: Nullable(CacheSalt) = None
    return_routed_experts: bool = False
    """SGLang's (MoE routing replay): `meta_info.routed_experts`, base64 of the little-endian int32 array
    [P + L - 1, num_moe_layers, top_k] (C order) of the experts chosen at every input position; streamed, in
    the last result."""
    lora_path: Union[str, Annotated[list[Union[str, None]], Field(min_length=1)], None] = Field(
        default=None, description="a loaded LoRA adapter's name, or a list of one (or null) per prompt")
    """SGLang's: the LoRA adapter (by the name it was loaded under) each prompt samples with; null: the base."""

    @model_validator(mode="after")
    def _one_prompt_field(self):
        if sum(f is not None for f in (self.text, self.input_ids, self.input_embeds)) != 1:
            raise ValueError("give one of 'text' or 'input_ids' (or 'input_embeds')")
        return self


class AbortRequest(_Strict):
    rid: str | None = Field(default=None, description="the rid a /generate request was sent with")
    abort_all: bool = False
    """Abort every request in flight (SGLang's; `rid` is then ignored)."""

    @model_validator(mode="after")
    def _rid_or_all(self):
        if self.rid is None and not self.abort_all:
            raise ValueError("give 'rid' or 'abort_all': true")
        return self


class PauseGenerationRequest(_Strict):
    """POST /pause_generation (SGLang's)."""

    mode: Literal["abort", "retract", "in_place"] = Field(
        default="abort", description='"abort", "retract" or "in_place"')
    """"abort": every request in flight ends now (finish_reason "abort"); "retract" and "in_place": they stay
    where they are (blocks kept) and go on after /continue_generation. New requests wait either way."""


class MemoryRequest(_Strict):
    tags: list[Literal["weights", "kv_cache"]] | None = Field(
        default=None, description='a list of "weights" and/or "kv_cache"')


WeightVersion = Annotated[str, Field(description='a decimal integer string such as "7" (the new policy version)')]


class UpdateWeightsFromDiskRequest(_Strict):
    model_path: str = Field(description="a checkpoint directory (safetensors of the served architecture)")
    version: int | None = Field(default=None, description="an integer (the new policy version)")
    weight_version: Nullable(WeightVersion) = None
    """SGLang's name of `version`, as a string; give one of the two."""
    flush_cache: bool = True
    abort_all_requests: bool = False
    """Abort every request in flight before loading (SGLang's)."""

    @model_validator(mode="after")
    def _one_version(self):
        if self.version is not None and self.weight_version is not None:
            raise ValueError("give version or weight_version, not both")
        return self


class InitWeightsUpdateGroupRequest(_Strict):
    """POST /init_weights_update_group (SGLang's): join the trainer's process group for weight broadcasts."""

    master_address: str = Field(min_length=1, description="a host name or address")
    master_port: int = Field(ge=1, le=65535, description="a port in [1, 65535]")
    rank_offset: int = Field(ge=1, description="an integer >= 1 (rank 0 is the trainer, which broadcasts)")
    world_size: int = Field(ge=2, description="an integer >= 2")
    group_name: str = Field(default="weight_update_group", min_length=1, description="a non-empty string")
    backend: Literal["gloo", "nccl"] = Field(default="nccl", description='"gloo" or "nccl"')

    @model_validator(mode="after")
    def _rank_in_world(self):
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset must be < world_size ({self.world_size}), got {self.rank_offset}")
        return self


class PatchBucket(_Strict):
    """One broadcast of a sparse push: a flat uint8 buffer of `nbytes` laid out as `header` says
    (weight_updates/wire.py's bucket: a safetensors header whose metadata lists the records)."""

    header: dict[str, Any]
    nbytes: int = Field(ge=0, description="an integer >= 0")


class UpdateWeightsFromDistributedRequest(_Strict):
    """POST /update_weights_from_distributed (SGLang's): rank 0 broadcasts one tensor per name, in order, of the
    announced dtype and shape; or, with `encoding: "patch"` (this engine's), one uint8 buffer per bucket."""

    names: Annotated[list[str], Field(min_length=1)] = Field(description="a non-empty list of parameter names")
    dtypes: list[str] | None = Field(default=None, description='a list of dtype names ("bfloat16"), one per name')
    shapes: list[list[Annotated[int, Field(ge=0)]]] | None = Field(
        default=None, description="a list of shapes (lists of integers >= 0), one per name")
    group_name: str = Field(default="weight_update_group", min_length=1, description="a non-empty string")
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Nullable(WeightVersion) = None
    load_format: str | None = None
    """SGLang's; only None (or "direct") is taken."""
    encoding: Literal["dense", "patch"] = Field(default="dense", description='"dense" or "patch"')
    buckets: list[PatchBucket] | None = None
    """With encoding "patch": the buckets rank 0 broadcasts, in order (and `names` lists their records)."""

    @model_validator(mode="after")
    def _fields_of_the_encoding(self):
        if self.load_format not in (None, "direct"):
            raise ValueError(f"load_format must be null or 'direct', got {self.load_format!r}")
        if self.encoding == "dense":
            if self.dtypes is None or self.shapes is None or self.buckets is not None:
                raise ValueError("encoding 'dense' takes names, dtypes and shapes (and no buckets)")
            if not len(self.names) == len(self.dtypes) == len(self.shapes):
                raise ValueError(f"names, dtypes and shapes must have one entry per tensor, got {len(self.names)}, "
                                 f"{len(self.dtypes)} and {len(self.shapes)}")
        elif self.buckets is None or self.dtypes is not None or self.shapes is not None:
            raise ValueError("encoding 'patch' takes names and buckets (and no dtypes or shapes)")
        return self


class DestroyWeightsUpdateGroupRequest(_Strict):
    group_name: str = Field(default="weight_update_group", min_length=1, description="a non-empty string")


# ---- responses -------------------------------------------------------------------------------------------------
def _none(value) -> bool:
    return value is None


def Extension(**kw):  # noqa: N802 (a Field)
    """An extension field: absent from the JSON unless set (so OpenAI's own objects stay as OpenAI sends them)."""
    return Field(default=None, exclude_if=_none, **kw)


class LoadLoraAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter (vLLM's): a PEFT adapter directory on the server's machine, under a name."""

    lora_name: str = Field(min_length=1, description="a non-empty string")
    lora_path: str = Field(min_length=1, description="a directory with adapter_config.json and "
                                                     "adapter_model.safetensors")


class UnloadLoraAdapterRequest(_Strict):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1, description="a non-empty string")
    lora_int_id: int | None = None
    """vLLM's numeric id of an adapter; taken and ignored (adapters are known by name here)."""


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens served from the prefix cache (summed over the samples of each prompt)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "rollout"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model (vLLM's field); None for the base model itself."""
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class _SampleExtensions(BaseModel):
    """This engine's per-sample extension fields, shared by every choice of a completion or chat response."""

    token_ids: list[int] | None = Extension()
    policy_versions: list[int] | None = Extension()
    """The engine's policy version when each token was sampled."""
    spec_decode_stats: dict | None = Extension()
    routed_experts: str | None = Extension()
    """base64 of the int32 [P + L - 1, num_moe_layers, top_k] array (little-endian, C order) of the completion's
    routed experts (`return_routed_experts`)."""
    routed_experts_shape: list[int] | None = Extension()
    """The shape of `routed_experts`: [P + L - 1, num_moe_layers, top_k]."""
    lora_versions: list[int] | None = Extension()
    """With a LoRA adapter (`model`): its version when each token was sampled."""


class CompletionChoice(_SampleExtensions):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict] | None] | None = Extension()
    prompt_token_ids: list[int] | None = Extension()


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCallOut(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCallOut


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: str = "function"
    function: FunctionCallOut


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = Extension()


class ChatChoice(_SampleExtensions):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Extension()
    prompt_logprobs: list[dict[str, dict] | None] | None = Extension()


class ChatDelta(BaseModel):
    role: str | None = Extension()
    content: str | None = Extension()
    tool_calls: list[ToolCallDelta] | None = Extension()


class ChatStreamChoice(_SampleExtensions):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Extension()


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = Extension()
    prompt_token_ids: list[int] | None = Extension()
    prompt_logprobs: list[dict[str, dict] | None] | None = Extension()


# ---- validation errors -> one message ---------------------------------------------------------------------------
def describe(error: ValidationError, model: type[BaseModel]) -> tuple[str, str | None]:
    """(message, param) of a request that failed `model`'s validation: its first problem, naming the field
    (dotted path, list positions in brackets) and the rule that field states, and how many more there are."""
    errors = error.errors(include_url=False)
    first = errors[0]
    path, rule, exact = _field_rule(model, first["loc"])
    kind = first["type"]
    if kind == "json_invalid":
        message = f"the request body is not valid JSON: {first['ctx']['error']}"
    elif kind == "model_type" and not path:
        message = "the request body must be a JSON object"
    elif kind == "extra_forbidden":
        parent = _field_rule(model, first["loc"][:-1])[0]
        path = f"{parent}.{first['loc'][-1]}" if parent else str(first["loc"][-1])
        known = _known_fields(model, first["loc"][:-1])
        message = f"unknown field '{path}'" + (f"; known here: {', '.join(known)}" if known else "")
    elif kind == "missing":
        message = f"{path} is required"
    elif kind == "value_error":
        message = str(first["ctx"]["error"])
    elif rule is not None:
        message = f"{path} must be {rule}" + (f", got {_short(first['input'])}" if exact else "")
    else:
        message = f"{path or 'the request'}: {first['msg']}"
    others = len({e["loc"] for e in errors} - {first["loc"]}) if rule is None else 0
    if others:
        message += f" (and {others} more problem{'s' if others > 1 else ''})"
    return message, path or None


def _field_rule(model: type[BaseModel], loc: tuple) -> tuple[str, str | None, bool]:
    """(dotted path, rule, exact) of an error at `loc`: the path and rule of the deepest described field on
    it (or the whole path and None), and whether the error is about that field's value itself rather than
    something inside it."""
    path, rule, rule_path, exact = "", None, "", False
    cls: type[BaseModel] | None = model
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            exact = False
            continue
        fields = cls.model_fields if cls is not None else {}
        if part not in fields:  # a union member's tag, e.g. 'list[int]': the union's rule says it all
            exact = False
            break
        info = fields[part]
        path = f"{path}.{part}" if path else part
        exact = False
        if info.description:
            rule, rule_path, exact = info.description, path, True
        cls = _model_in(info.annotation)
    return (rule_path, rule, exact) if rule is not None else (path, None, False)


def _model_in(annotation) -> type[BaseModel] | None:
    """The BaseModel class inside an annotation like `X`, `X | None`, `list[X]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _model_in(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType, list):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def _known_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    cls: type[BaseModel] | None = model
    for part in loc:
        if isinstance(part, str) and cls is not None and part in cls.model_fields:
            cls = _model_in(cls.model_fields[part].annotation)
    return sorted(cls.model_fields) if cls is not None else []


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
