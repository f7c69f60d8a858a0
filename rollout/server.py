"""The HTTP server (FastAPI on uvicorn) in front of an `AsyncEngine`: OpenAI's API as the `openai` SDK and agentic
RL clients call it, and SGLang's native `/generate` and RL control endpoints.

    python -m rollout serve --model DIR [--host 127.0.0.1] [--port 30000] [--api-key KEY]

    GET  /health                      {"status": "ok"}; never needs the API key (for probes)
    GET  /v1/models, /v1/models/{id}  the served model (`ServerConfig.served_model_name`) and the loaded LoRA
                                      adapters (their `parent`: the served model)
    POST /v1/completions              OpenAI's: prompt (text, texts, token ids, lists of token ids), n, stream
                                      (server-sent events of text deltas; a usage chunk with
                                      stream_options.include_usage), echo, logprobs (top-N, text_offset), stop,
                                      seed, max_tokens, temperature, top_p, top_k, min_p, usage; vLLM's
                                      return_token_ids, return_tokens_as_token_ids, prompt_logprobs, cache_salt,
                                      prompt_embeds (base64 safetensors, below)
    POST /v1/chat/completions         OpenAI's: messages rendered with the model's chat template, tools and
                                      tool_choice ("auto" / "none"), tool calls parsed into `tool_calls`,
                                      streaming deltas, logprobs / top_logprobs, and the same extensions
    POST /generate                    SGLang's: {"text" | "input_ids" | "input_embeds", "sampling_params", "return_logprob",
                                      "top_logprobs_num", "rid", "stream", "return_routed_experts", "lora_path"};
                                      one result per sample
    GET  /get_model_info              {"model_path", "served_model_name", "policy_version", "has_tokenizer", ...}
    GET  /get_weight_version          {"weight_version": "7"}: the policy version as SGLang's string
    GET  /health_generate             200 once the engine generated a token (while paused: at once; asleep: once
                                      the engine's thread answers)
    GET  /server_info, /get_server_info  the model, limits, weight version and pause state
    GET  /v1/loads                    {"loads": [{"num_running_reqs", "num_waiting_reqs", "num_reqs"}]}
    admin (ServerConfig.enable_admin):
    POST /abort_request               {"rid"} or {"abort_all": true}: those /generate calls return what they
                                      have, finish_reason "abort"
    POST /pause_generation            {"mode"?: "abort" (default) | "retract" | "in_place"}: no engine steps
                                      until /continue_generation; "abort" first ends every request in flight
    POST /continue_generation         step again
    GET|POST /flush_cache             empty the prefix cache (blocks in use stay in use)
    POST /release_memory_occupation   {"tags"?}: Engine.sleep (level 2 when the tags include "weights")
    POST /resume_memory_occupation    {"tags"?}: Engine.wake_up(tags)
    POST /update_weights_from_disk    {"model_path", "version"? | "weight_version"?}: Engine.load_weights,
                                      validated before writing
    POST /v1/load_lora_adapter        vLLM's {"lora_name", "lora_path"}: Engine.load_lora (a PEFT adapter directory
                                      on this machine); 400 for a name in use, no free slot or a bad adapter
    POST /v1/unload_lora_adapter      vLLM's {"lora_name"}: Engine.unload_lora; 404 for an unknown name, 400 while
                                      requests of the adapter run
    POST /init_weights_update_group   {"master_address", "master_port", "rank_offset", "world_size",
                                      "group_name", "backend"}: join the trainer's process group
    POST /update_weights_from_distributed  {"names", "dtypes", "shapes", "group_name", "weight_version",
                                      "flush_cache"} while the trainer broadcasts each tensor from rank 0 (or
                                      "encoding": "patch" with "buckets"): one validate-then-apply session; while
                                      paused, the calls of one weight_version are one session, staged call by
                                      call and applied (or refused whole) at /continue_generation
    POST /destroy_weights_update_group  {"group_name"}

`weight_version` is the engine's policy version written as a decimal string ("7" <-> 7). A weight push runs as one
command on the engine's thread (no step runs during it) and through the engine's weight sink: a wrong name, shape
or dtype, or a broadcast that breaks off (sender gone, ServerConfig.weight_group_timeout_s), is refused with a 400
and the old weights and version stay (a group whose broadcast broke off is destroyed: join a new one).

Every request body is validated by its rollout/protocol.py model (unknown fields, wrong types, NaN refused),
then against the engine and the server's limits (ServerConfig: n, prompt and completion tokens, body size,
pending prompts, cache-salt length, token ids in the vocabulary). Every error is OpenAI's shape
{"error": {"message", "type", "param", "code"}}: 400 invalid_request_error, 401 authentication_error,
404 not_found_error, 413 (body too large), 429 rate_limit_error with Retry-After (too many pending prompts),
503 (no free KV blocks to score a prompt now; the engine stopped). A client that disconnects aborts its
requests, streaming or not, and costs one log line.

LoRA (an engine with `EngineConfig.max_loras > 0`): the OpenAI `model` field names the served model (the base) or a
loaded adapter, which the request then samples with (and its prompt logprobs are scored with); another name is a
404 `model_not_found`, as vLLM answers. Responses carry the name asked for, and adapter choices (and /generate's
`meta_info`) the adapter's version per token (`lora_versions`). /generate takes SGLang's `lora_path`: an adapter's
name (or a list, one per prompt); an unknown one is a 400.

Prompt embeddings (an engine that takes them: `Engine.prompt_embeds_refusal()` is None): /v1/completions takes vLLM's
`prompt_embeds`, a string or a list of strings, each the base64 of a safetensors blob holding one floating-point
tensor [T, hidden_size] (`rollout.prompt_embeds.encode_prompt_embeds`; vLLM's clients send `torch.save` output, which
this server refuses: it never unpickles what a client sends), with `prompt` left out or "" (a text or token prompt
together with embeddings is a 400). /generate takes SGLang's `input_embeds`, JSON numbers [T][hidden_size] (or a list
of such prompts). Both are checked as the engine checks them (rollout/prompt_embeds.py: 2-D, the hidden size, a
floating dtype cast to the model's, finite, 1 <= T <= max_prompt_tokens), each refusal a 400 naming the field
(`prompt_embeds[1]` in a list); their size is bounded by max_body_bytes. They have no token ids: `echo` and
`prompt_logprobs` are refused with them, `prompt_token_ids` are null, and usage counts T prompt tokens.

Every choice carries the policy version of each of its tokens (`policy_versions`) and, when speculating,
its acceptance counters (`spec_decode_stats`). MoE routing replay: with `return_routed_experts`, /generate's
`meta_info.routed_experts` (SGLang's field) and the OpenAI choices' `routed_experts` (with
`routed_experts_shape`) are base64 of the little-endian int32 array [P + L - 1, num_moe_layers, top_k] of the
experts chosen at every input position (`CompletionOutput.routed_experts`); streamed, in the last chunk of a
choice (the last result of /generate). A model without MoE layers refuses the field with a 400. `prompt_logprobs` (and `echo` with `logprobs`) score the prompt
in a scoring pass between engine steps (runner/scoring.py) over KV blocks lent from the engine's pool, once per
prompt; those are the model's raw logprobs (no temperature), as vLLM returns them.

Not here: chat templates (rollout/chat.py), tool-call formats (rollout/tool_parsers.py), flags
(rollout/cli.py), weight pushes of tensor data (weight_updates/ transports).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from rollout import protocol as P
from rollout.async_engine import AsyncEngine
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.sampling_params import SamplingParams
from rollout.server_config import ServerConfig

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "internal_server_error", 503: "service_unavailable"}
_PARSE_IN_THREAD_BYTES = 1 << 20  # bodies this large are parsed off the event loop
_LOGPROB_FLOOR = -9999.0  # what a -inf logprob (a token truncated away) is sent as (vLLM's convention)


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


class _Disconnected(Exception):
    """The client went away before its answer was ready (its requests were aborted)."""


def _error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    info = P.ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "invalid_request_error"), param=param,
                       code=code)
    return P.ErrorResponse(error=info).model_dump_json().encode()


def _error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                    headers: dict[str, str] | None = None) -> Response:
    return Response(_error_body(status, message, param, code), status_code=status, media_type="application/json",
                    headers=headers)


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _LOGPROB_FLOOR


def _usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> P.Usage:
    return P.Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens,
                   prompt_tokens_details=P.PromptTokensDetails(cached_tokens=num_cached_tokens))


def _routed(rows: np.ndarray | None) -> tuple[str, list[int]] | tuple[None, None]:
    """(base64 of the int32 array's bytes, little-endian and C order, as SGLang sends `routed_experts`; its
    shape), or (None, None) when there are none."""
    if rows is None:
        return None, None
    return base64.b64encode(np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode("ascii"), list(rows.shape)


def _prompt_len(prompt: list[int] | dict) -> int:
    """The prompt tokens of a prompt as handlers pass it on: token ids, or an embedding prompt's rows."""
    return prompt["prompt_embeds"].num_tokens if isinstance(prompt, dict) else len(prompt)


def _embeds_rows(rows: list, where: str):
    """SGLang's `input_embeds` of one prompt (JSON numbers [T][hidden_size]) as a float64 tensor (cast once, to the
    model's dtype, by the check)."""
    import torch

    try:
        return torch.tensor(rows, dtype=torch.float64)
    except (ValueError, TypeError):
        raise ValueError(f"{where} must be rows of equal length [T][hidden_size]") from None


def _stops(stop: str | list[str] | None) -> list[str]:
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


class _ApiKey:
    """ASGI middleware: every path but /health needs `Authorization: Bearer <key>`; a 401 otherwise."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health" or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = _error_body(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                          code="invalid_api_key")
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False


async def _wait_disconnect(receive) -> None:
    """Returns once the client has gone (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """Server-sent events from `events` (each already `data: ...\\n\\n`), watching for the client to go: then
    the stream is cancelled (its engine requests abort) and one line is logged. `cleanup` runs either way."""

    def __init__(self, events: AsyncIterator[bytes], name: str, cleanup: Callable[[], Any] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                          "X-Accel-Buffering": "no"})
        self.events, self.name, self.cleanup = events, name, cleanup

    async def __call__(self, scope, receive, send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not pump.done():
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
                logger.info("client left stream %s; its requests were aborted", self.name)
            elif pump.exception() is not None and isinstance(pump.exception(), OSError):
                logger.info("client left stream %s; its requests were aborted", self.name)
            else:
                pump.result()
        finally:
            for task in (pump, watch):
                task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
            await self.events.aclose()
            if self.cleanup is not None:
                await self.cleanup()

    async def _pump(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _event(payload: BaseModel | dict | list) -> bytes:
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return b"data: " + text.encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class _Streams:
    """The delta outputs of several prompts' `AsyncEngine.stream`s, merged in arrival order. `first()` waits
    until every prompt has its first output (so a refused prompt raises before a response starts); iterating
    yields (prompt index, delta) until every prompt has finished; `close()` aborts whatever still runs."""

    def __init__(self, engine: AsyncEngine, requests: list[tuple[list[int], SamplingParams, str]]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._tasks = [asyncio.ensure_future(self._pump(i, engine.stream(ids, params, request_id=rid)))
                       for i, (ids, params, rid) in enumerate(requests)]
        self._unfinished = len(requests)

    async def _pump(self, i: int, outputs: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in outputs:
                self._queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 (handed to the reader)
            self._queue.put_nowait((i, e))

    async def _next(self) -> tuple[int, RequestOutput]:
        i, item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        if item.finished:
            self._unfinished -= 1
        return i, item

    async def first(self) -> None:
        seen: set[int] = set()
        while len(seen) < len(self._tasks):
            i, out = await self._next()
            seen.add(i)
            self._buffer.append((i, out))

    async def __aiter__(self):
        while self._buffer:
            yield self._buffer.pop(0)
        while self._unfinished:
            yield await self._next()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _score_prompt(engine, token_ids: list[int], num_top: int, lora: str | None = None) -> dict:
    """On the engine's thread, between steps: runner/scoring.py's prompt logprobs (with LoRA adapter `lora`) over
    KV blocks lent from the pool for the call (so running requests keep theirs). Raises APIError 503 when the pool
    lacks the blocks."""
    if engine.is_sleeping:
        raise ValueError("prompt logprobs while the engine sleeps: resume it first")
    slot = -1
    if lora is not None:
        slots = {info.name: info.slot for info in engine.list_loras()}
        if lora not in slots:
            raise APIError(404, f"the model {lora!r} does not exist (its LoRA adapter was unloaded)", param="model",
                           code="model_not_found")
        slot = slots[lora]
    elif any(info.merged for info in engine.list_loras()):  # EngineConfig.lora_merged: slot -1 is the adapter's
        raise APIError(400, "the base model is not served while a LoRA adapter is merged into its weights "
                            "(EngineConfig.lora_merged): name the adapter in `model`", param="model")
    pool = engine.kv_manager.pool
    need = -(-len(token_ids) // engine.config.block_size)
    if need > pool.num_free_blocks:
        raise APIError(503, f"scoring this prompt needs {need} free KV blocks and {pool.num_free_blocks} are free "
                            "now; retry later", code="kv_cache_full")
    blocks = pool.allocate(need)
    try:
        return engine.collective_rpc("runner.scoring:prompt_logprobs", list(token_ids), blocks, num_top, slot)[0]
    finally:
        pool.free(blocks)


class _Server:
    """The handlers, the engine facts they check requests against, and the pending-prompt count."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        from rollout.chat import ChatTemplate
        from rollout.tool_parsers import ToolParsers

        self.engine, self.config = engine, config
        eng = engine.engine
        self.model_path = str(eng.config.model)
        self.served_model_name = config.served_model_name or self.model_path
        self.tokenizer = eng.tokenizer
        self.vocab_size = eng.model_config.vocab_size
        self.max_model_len = eng.max_model_len
        self.max_prompt_tokens = min(config.max_prompt_tokens or eng.max_model_len - 1, eng.max_model_len - 1)
        self.max_tokens = min(config.max_tokens or eng.max_model_len, eng.max_model_len)
        self.routed_experts_refusal = eng.routed_experts_refusal()  # None: requests may ask for routed experts
        self.prompt_embeds_refusal = eng.prompt_embeds_refusal()  # None: embedding prompts are taken
        self.hidden_size, self.model_dtype = eng.model_config.hidden_size, eng.runner.dtype
        self.template = ChatTemplate.from_model_dir(eng.tokenizer_dir, override=config.chat_template)
        # loaded LoRA adapters by name (their LoraInfo): the engine's at start and after each load / unload here
        self.loras = {info.name: info for info in eng.list_loras()}
        self.tool_parser = ToolParsers.get(config.tool_parser)
        self.created = int(time.time())
        self.pending = 0  # prompts admitted and not yet answered (the event loop's thread only)
        self.paused = False  # /pause_generation until /continue_generation (the event loop's thread only)
        self.groups: dict[str, Any] = {}  # group_name -> torch process group (/init_weights_update_group)
        self.span: _Span | None = None  # a paused push whose calls join one update (the event loop's thread only)
        self._token_text: dict[int, str] = {}

    # ---- request plumbing ---------------------------------------------------------------------------------
    async def parse(self, request: Request, model: type[BaseModel]):
        """The body, validated by `model`; 413 past max_body_bytes, 400 naming the first problem."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        too_large = APIError(413, f"the request body exceeds the server's max_body_bytes={limit}",
                             code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:
            logger.info("client left before its request to %s was read; nothing was started", request.url.path)
            raise _Disconnected from None
        body = b"".join(chunks)
        try:
            if len(body) > _PARSE_IN_THREAD_BYTES:
                return await asyncio.to_thread(model.model_validate_json, body)
            return model.model_validate_json(body)
        except ValidationError as e:
            message, param = P.describe(e, model)
            raise APIError(400, message, param=param) from None

    def admit(self, num_prompts: int) -> Callable[[], None]:
        """Count `num_prompts` more pending prompts (429 past max_pending_requests); returns their release."""
        limit = self.config.max_pending_requests
        if num_prompts > limit:
            raise APIError(400, f"a request may carry at most {limit} prompts (the server's max_pending_requests), "
                                f"got {num_prompts}", param="prompt")
        if self.pending + num_prompts > limit:
            raise APIError(429, f"{self.pending} prompts are pending and the server takes at most {limit}; retry "
                                "later", code="too_many_pending_requests",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        self.pending += num_prompts
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.pending -= num_prompts

        return release

    async def until_disconnect(self, request: Request, name: str, work):
        """Await `work` unless the client leaves first: then it is cancelled (aborting its engine requests)."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            logger.info("client left before %s finished; its requests were aborted", name)
            raise _Disconnected
        return task.result()

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names: None for the served (base) model or no name; a 404 in
        OpenAI's shape for a model that is neither."""
        if model is None or model == self.served_model_name:
            return None
        if model in self.loras:
            return model
        adapters = f" and the LoRA adapters {sorted(self.loras)}" if self.loras else ""
        raise APIError(404, f"the model {model!r} does not exist; this server serves {self.served_model_name!r}"
                            f"{adapters}", param="model", code="model_not_found")

    def model_name(self, req: BaseModel) -> str:
        """The model a response names: the one the request asked for (an adapter's name), else the served one."""
        return req.model if req.model is not None else self.served_model_name

    def check_lora_path(self, lora_path, num_prompts: int) -> list[str | None]:
        """/generate's `lora_path` as one adapter name (or None) per prompt; a 400 naming the field otherwise."""
        names = lora_path if isinstance(lora_path, list) else [lora_path] * num_prompts
        if len(names) != num_prompts:
            raise APIError(400, f"lora_path must be a name or a list of one per prompt ({num_prompts}), got "
                                f"{len(names)}", param="lora_path")
        for name in names:
            if name is not None and name not in self.loras:
                loaded = sorted(self.loras) or "none"
                raise APIError(400, f"lora_path: no LoRA adapter named {name!r} is loaded (loaded: {loaded})",
                               param="lora_path")
        return names

    def check_common(self, n: int, cache_salt: str | None, stop_token_ids: list[int] | None,
                     max_tokens: int | None, param_max_tokens: str = "max_tokens") -> None:
        if n > self.config.max_n:
            raise APIError(400, f"n must be <= {self.config.max_n} (the server's max_n), got {n}", param="n")
        if cache_salt is not None and len(cache_salt) > self.config.max_cache_salt_chars:
            raise APIError(400, f"cache_salt must have at most {self.config.max_cache_salt_chars} characters, got "
                                f"{len(cache_salt)}", param="cache_salt")
        bad = [t for t in stop_token_ids or () if t >= self.vocab_size]
        if bad:
            raise APIError(400, f"stop_token_ids {bad[:5]} lie outside the vocabulary [0, {self.vocab_size})",
                           param="stop_token_ids")
        if max_tokens is not None and max_tokens > self.max_tokens:
            raise APIError(400, f"{param_max_tokens} must be <= {self.max_tokens} (the server's bound), got "
                                f"{max_tokens}", param=param_max_tokens)

    def check_routed_experts(self, asked: bool) -> None:
        if asked and self.routed_experts_refusal is not None:
            raise APIError(400, f"return_routed_experts: {self.routed_experts_refusal}", param="return_routed_experts")

    def bounded_default(self, req: BaseModel, name: str) -> int:
        """`req.<name>` (a completion-token count) as given, or its default capped at the server's bound."""
        value = getattr(req, name)
        return value if name in req.model_fields_set else min(value, self.max_tokens)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, f"{param} is empty", param=param)
        if len(ids) > self.max_prompt_tokens:
            raise APIError(400, f"{param} has {len(ids)} tokens; this server takes at most {self.max_prompt_tokens}",
                           param=param, code="context_length_exceeded")
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise APIError(400, f"{param} has token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})",
                           param=param)

    async def embeds_prompts(self, tensors: list[Callable[[str], Any]], param: str, indexed: bool) -> list[dict]:
        """The engine's dict prompts of embedding tensors, each made by a callable (of the field's name, for its
        errors: a ValueError) and checked off the event loop; a 400 naming `param` (`param[i]` when `indexed`)."""
        from rollout.prompt_embeds import check_prompt_embeds

        if self.prompt_embeds_refusal is not None:
            raise APIError(400, f"{param}: {self.prompt_embeds_refusal}", param=param)

        def check(i: int, value) -> dict:
            where = f"{param}[{i}]" if indexed else param
            try:
                embeds = check_prompt_embeds(value(where), hidden_size=self.hidden_size, dtype=self.model_dtype,
                                             field=where)
            except ValueError as e:
                raise APIError(400, str(e), param=where) from None
            if embeds.num_tokens > self.max_prompt_tokens:
                raise APIError(400, f"{where} has {embeds.num_tokens} rows (prompt positions); this server takes at "
                                    f"most {self.max_prompt_tokens}", param=where, code="context_length_exceeded")
            return {"prompt_embeds": embeds}

        return await asyncio.to_thread(lambda: [check(i, t) for i, t in enumerate(tensors)])

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, f"{param} is text but the model has no tokenizer.json; send token ids", param=param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def sampling(self, **fields) -> SamplingParams:
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = "" if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def token_name(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.token_text(token_id)

    async def generate_all(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None,
                           rids: list[str], score_top: int | None = None, lora: str | None = None
                           ) -> tuple[list[RequestOutput | None], list[dict | None]]:
        """Every prompt's final output (engine request ids `rids`; `params` for all, or one per prompt; None each
        when `params` is None: nothing to generate) and, with `score_top`, its prompt scores (with adapter `lora`);
        one failure cancels (aborts) the rest and raises as an APIError."""
        tasks = []
        if params is not None:
            each = params if isinstance(params, list) else [params] * len(prompts)
            tasks += [asyncio.ensure_future(self.engine.generate(ids, p, request_id=r))
                      for ids, p, r in zip(prompts, each, rids)]
        if score_top is not None:
            tasks += [asyncio.ensure_future(self.score(ids, score_top, lora)) for ids in prompts]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException as e:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise _engine_error(e) from None
        outs = results[: len(prompts)] if params is not None else [None] * len(prompts)
        scores = results[-len(prompts):] if score_top is not None else [None] * len(prompts)
        return outs, scores

    async def score(self, ids: list[int], num_top: int, lora: str | None = None) -> dict:
        if len(ids) < 2:
            return {"logprobs": [], "ranks": [], "top_ids": [], "top_logprobs": []}
        return await self.engine.call(lambda e: _score_prompt(e, ids, num_top, lora))

    # ---- response pieces -----------------------------------------------------------------------------------
    def prompt_logprobs(self, ids: list[int], score: dict, num_top: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first token, then per token {token id: {"logprob", "rank",
        "decoded_token"}} for the prompt's token and the `num_top` most likely."""
        out: list[dict | None] = [None]
        for i, t in enumerate(ids[1:]):
            entry = {str(t): {"logprob": _finite(score["logprobs"][i]), "rank": score["ranks"][i],
                              "decoded_token": self.token_text(t)}}
            for rank, (tid, lp) in enumerate(zip(score["top_ids"][i][:num_top], score["top_logprobs"][i]), 1):
                entry.setdefault(str(tid), {"logprob": _finite(lp), "rank": rank,
                                            "decoded_token": self.token_text(tid)})
            out.append(entry)
        return out

    def completion_logprobs(self, token_ids: list[int], logprobs: list[float | None],
                            top: list[list[tuple[int, float]]] | None, num_top: int, as_ids: bool,
                            offset: int) -> tuple[P.CompletionLogprobs, int]:
        """OpenAI's legacy logprobs of `token_ids` (a None logprob: the prompt's first token): each position's
        top logprobs hold the `num_top` most likely tokens and the chosen one, most likely first; text
        offsets count characters of the tokens' texts from `offset`; returns them and the offset after the last."""
        tokens, offsets, tops = [], [], []
        for j, t in enumerate(token_ids):
            tokens.append(self.token_name(t, as_ids))
            offsets.append(offset)
            offset += len(self.token_text(t))
            if logprobs[j] is None:
                tops.append(None)
                continue
            entry: dict[str, float] = {}
            for tid, lp in (top[j] if top else ())[:num_top]:
                entry.setdefault(self.token_name(tid, as_ids), _finite(lp))
            entry.setdefault(tokens[-1], _finite(logprobs[j]))
            tops.append(dict(sorted(entry.items(), key=lambda kv: -kv[1])))
        return P.CompletionLogprobs(text_offset=offsets, tokens=tokens, top_logprobs=tops,
                                    token_logprobs=[None if lp is None else _finite(lp) for lp in logprobs]), offset

    def chat_logprobs(self, c: CompletionOutput, num_top: int, as_ids: bool) -> P.ChatLogprobs:
        content = []
        for j, t in enumerate(c.token_ids):
            name = self.token_name(t, as_ids)
            top = [P.ChatTopLogprob(token=self.token_name(tid, as_ids), logprob=_finite(lp),
                                    bytes=list(self.token_text(tid).encode()))
                   for tid, lp in (c.top_logprobs[j] if c.top_logprobs else ())[:num_top]]
            content.append(P.ChatTokenLogprob(token=name, logprob=_finite(c.logprobs[j]), top_logprobs=top,
                                              bytes=list(self.token_text(t).encode())))
        return P.ChatLogprobs(content=content)

    # ---- endpoints ---------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def models(self, request: Request) -> Response:
        return _json(P.ModelList(data=[self._card(None)] + [self._card(name) for name in self.loras]))

    async def model(self, request: Request) -> Response:
        return _json(self._card(self.check_model(request.path_params["model"])))

    def _card(self, lora: str | None) -> P.ModelCard:
        """The base model's card (`lora` None), or a loaded adapter's, whose parent is the base (vLLM's)."""
        if lora is None:
            return P.ModelCard(id=self.served_model_name, created=self.created, root=self.model_path,
                               max_model_len=self.max_model_len)
        return P.ModelCard(id=lora, created=self.created, root=self.loras[lora].path, parent=self.served_model_name,
                           max_model_len=self.max_model_len)

    async def model_info(self, request: Request) -> Response:
        version = await self.engine.call(lambda e: e.policy_version)
        return Response(json.dumps({"model_path": self.model_path, "served_model_name": self.served_model_name,
                                    "policy_version": version, "has_tokenizer": self.tokenizer is not None,
                                    "max_model_len": self.max_model_len, "is_generation": True}),
                        media_type="application/json")

    async def completions(self, request: Request) -> Response:
        req: P.CompletionRequest = await self.parse(request, P.CompletionRequest)
        lora = self.check_model(req.model)
        max_tokens = self.bounded_default(req, "max_tokens")
        self.check_common(req.n, req.cache_salt, req.stop_token_ids, max_tokens)
        self.check_routed_experts(req.return_routed_experts)
        if req.return_routed_experts and max_tokens == 0:
            raise APIError(400, "return_routed_experts needs max_tokens >= 1 (max_tokens 0 runs no generation)",
                           param="return_routed_experts")
        p = req.prompt
        if p is None and req.prompt_embeds is None:
            raise APIError(400, "prompt is required (or prompt_embeds)", param="prompt")
        items = [] if req.prompt_embeds is not None else [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        texts, prompts = [], []
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                ids = self.encode(item, req.add_special_tokens, param)
            else:
                ids = list(item)
            self.check_prompt(ids, param)
            texts.append(item if isinstance(item, str) else None)
            prompts.append(ids)
        if req.prompt_embeds is not None:
            texts, prompts = await self.completion_embeds(req)
        params = None
        if max_tokens > 0:
            params = self.sampling(
                n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed, stop=_stops(req.stop),
                stop_token_ids=req.stop_token_ids or [], include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos, top_logprobs=req.logprobs or 0, skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens, cache_salt=req.cache_salt,
                return_routed_experts=req.return_routed_experts, lora=lora)
        echo_logprobs = req.echo and req.logprobs is not None
        score_top = None
        if echo_logprobs or req.prompt_logprobs is not None:
            score_top = max((req.logprobs or 0) if echo_logprobs else 0, req.prompt_logprobs or 0)
        if req.echo:  # a token-id prompt is echoed as its text
            decode = self.tokenizer.decode if self.tokenizer is not None else (lambda ids, _: "")
            texts = [t if t is not None else decode(ids, False) for t, ids in zip(texts, prompts)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        release = self.admit(len(prompts))
        if req.stream and params is not None:
            return await self._stream_completions(request, req, rid, texts, prompts, params, score_top, release, lora)
        # otherwise one answer (a stream of max_tokens 0 has one chunk per choice)
        try:
            outs, scores = await self.until_disconnect(request, rid, self.generate_all(
                prompts, params, [f"{rid}-{i}" for i in range(len(prompts))], score_top, lora))
        finally:
            release()
        choices, completion_tokens = [], 0
        for i, (text, ids, out, score) in enumerate(zip(texts, prompts, outs, scores)):
            samples = out.outputs if out is not None else [
                CompletionOutput(index=j, token_ids=[], logprobs=[], finish_reason="length", policy_versions=[],
                                 text="") for j in range(req.n)]
            for c in samples:
                completion_tokens += len(c.token_ids)
                choices.append(self._completion_choice(req, i * req.n + c.index, c, text, ids, score, first=True)[0])
        usage = _usage(sum(map(_prompt_len, prompts)), completion_tokens,
                       sum(out.num_cached_prompt_tokens for out in outs if out is not None))
        created = int(time.time())
        if not req.stream:
            return _json(P.CompletionResponse(id=rid, created=created, model=self.model_name(req), choices=choices,
                                              usage=usage))

        async def events():
            for choice in choices:
                yield _event(P.CompletionResponse(id=rid, created=created, model=self.model_name(req),
                                                  choices=[choice]))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _event(P.CompletionResponse(id=rid, created=created, model=self.model_name(req), choices=[],
                                                  usage=usage))
            yield _DONE

        return _EventStream(events(), rid)

    async def completion_embeds(self, req: P.CompletionRequest) -> tuple[list[None], list[dict]]:
        """/v1/completions' `prompt_embeds` as (texts, the engine's dict prompts); 400s naming the field."""
        from rollout.prompt_embeds import decode_prompt_embeds

        if req.prompt not in (None, "", [""]):
            raise APIError(400, "prompt_embeds cannot be combined with a text or token prompt: leave prompt out or "
                                "send \"\"", param="prompt_embeds")
        for name, given in (("echo", req.echo), ("prompt_logprobs", req.prompt_logprobs is not None)):
            if given:
                raise APIError(400, f"{name} with prompt_embeds: an embedding prompt has no token ids to echo or score",
                               param=name)
        blobs = req.prompt_embeds if isinstance(req.prompt_embeds, list) else [req.prompt_embeds]
        prompts = await self.embeds_prompts([lambda where, b=b: decode_prompt_embeds(b, where) for b in blobs],
                                            "prompt_embeds", indexed=len(blobs) > 1)
        return [None] * len(prompts), prompts

    def _completion_choice(self, req: P.CompletionRequest, index: int, c: CompletionOutput, prompt_text: str | None,
                           prompt_ids: list[int], score: dict | None, first: bool,
                           offset: int = 0) -> tuple[P.CompletionChoice, int]:
        """One choice (or, streaming, one delta of it: `first` marks the first, which carries the echo and
        the prompt's extensions; `offset` is where its text starts in the whole choice's text), and where the
        next delta's text starts."""
        echo = req.echo and first
        text = (prompt_text if echo else "") + (c.text or "")
        choice = P.CompletionChoice(index=index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                    policy_versions=c.policy_versions, spec_decode_stats=c.spec_decode_stats,
                                    lora_versions=c.lora_versions)
        choice.routed_experts, choice.routed_experts_shape = _routed(c.routed_experts)
        if req.logprobs is not None:
            ids, lps, top = list(c.token_ids), list(c.logprobs or [None] * len(c.token_ids)), c.top_logprobs
            if echo:
                k = req.logprobs
                prompt_top = [None] + [list(zip(score["top_ids"][j][:k], score["top_logprobs"][j][:k]))
                                       for j in range(len(prompt_ids) - 1)]
                ids, lps = prompt_ids + ids, [None] + score["logprobs"] + lps
                top = prompt_top + (top or [[]] * len(c.token_ids))
            choice.logprobs, offset = self.completion_logprobs(ids, lps, top, req.logprobs,
                                                               req.return_tokens_as_token_ids, offset)
        if first and req.prompt_logprobs is not None:
            choice.prompt_logprobs = self.prompt_logprobs(prompt_ids, score, req.prompt_logprobs)
        if req.return_token_ids:
            choice.token_ids = c.token_ids
            if first:
                choice.prompt_token_ids = None if isinstance(prompt_ids, dict) else prompt_ids
        return choice, offset

    async def _open(self, request: Request, rid: str, streams: "_Streams", start, release) -> Any:
        """Await `start` (the streams' first outputs, prompt scoring) unless the client leaves; on any failure the
        streams are closed, the admission released and the error raised as its HTTP error."""
        try:
            return await self.until_disconnect(request, rid, start)
        except BaseException as e:
            await streams.close()
            release()
            raise _engine_error(e) from None

    @staticmethod
    def _event_stream(body: AsyncIterator[bytes], rid: str, streams: "_Streams", release) -> "_EventStream":
        """The server-sent events of `body`, then [DONE]; an error once the response has started becomes an
        event; the streams are closed and the admission released however the stream ends."""
        async def events():
            try:
                async for event in body:
                    yield event
            except Exception as e:  # noqa: BLE001 (the response has started: the error becomes an event)
                yield _stream_error(e)
            yield _DONE

        async def cleanup():
            await streams.close()
            release()

        return _EventStream(events(), rid, cleanup)

    async def _stream_completions(self, request, req, rid, texts, prompts, params, score_top, release,
                                  lora) -> Response:
        streams = _Streams(self.engine, [(ids, params, f"{rid}-{i}") for i, ids in enumerate(prompts)])

        async def start():
            scores = [None] * len(prompts)
            if score_top is not None:
                scores = await asyncio.gather(*(self.score(ids, score_top, lora) for ids in prompts))
            await streams.first()
            return scores

        scores = await self._open(request, rid, streams, start(), release)

        async def events():
            created, n = int(time.time()), req.n
            started: set[int] = set()
            offsets: dict[int, int] = {}
            completion_tokens = 0
            cached = [0] * len(prompts)
            async for i, out in streams:
                cached[i] = out.num_cached_prompt_tokens
                for c in out.outputs:
                    index = i * n + c.index
                    first = index not in started
                    started.add(index)
                    completion_tokens += len(c.token_ids)
                    choice, offsets[index] = self._completion_choice(
                        req, index, c, texts[i], prompts[i], scores[i], first, offsets.get(index, 0))
                    yield _event(P.CompletionResponse(id=rid, created=created, model=self.model_name(req),
                                                      choices=[choice]))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _event(P.CompletionResponse(id=rid, created=created, model=self.model_name(req),
                                                  choices=[], usage=_usage(sum(map(_prompt_len, prompts)),
                                                                           completion_tokens, sum(cached))))

        return self._event_stream(events(), rid, streams, release)

    async def chat_completions(self, request: Request) -> Response:
        req: P.ChatCompletionRequest = await self.parse(request, P.ChatCompletionRequest)
        lora = self.check_model(req.model)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.check_common(req.n, req.cache_salt, req.stop_token_ids, max_tokens,
                          "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        self.check_routed_experts(req.return_routed_experts)
        if self.template is None:
            raise APIError(400, "this model has no chat template (tokenizer_config.json's chat_template or "
                                "chat_template.jinja): give the server one (ServerConfig.chat_template) or use "
                                "/v1/completions", param="messages")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]  # rollout/chat.py normalizes them
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            ids = self.template.render(messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
                                       chat_template_kwargs=req.chat_template_kwargs)
        except ValueError as e:
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None
        self.check_prompt(ids, "messages")
        if max_tokens is None:
            max_tokens = min(self.max_tokens, self.max_model_len - len(ids))
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        num_top = (req.top_logprobs or 0) if req.logprobs else 0
        params = self.sampling(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed, stop=_stops(req.stop),
            stop_token_ids=req.stop_token_ids or [], include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos, top_logprobs=num_top, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens, cache_salt=req.cache_salt,
            return_routed_experts=req.return_routed_experts, lora=lora)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        release = self.admit(1)
        if req.stream:
            return await self._stream_chat(request, req, rid, ids, params, parse_tools, num_top, release, lora)
        try:
            (out,), (score,) = await self.until_disconnect(request, rid, self.generate_all(
                [ids], params, [rid], req.prompt_logprobs, lora))
        finally:
            release()
        choices, completion_tokens = [], 0
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            text = c.text or ""
            calls = []
            content: str | None = text
            if parse_tools:
                parsed = self.tool_parser.parse(text)
                content, calls = parsed.content, parsed.tool_calls
            finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            message = P.ChatMessageOut(content=content, tool_calls=[
                P.ToolCallOut(id=tc.id, function=P.FunctionCallOut(name=tc.name, arguments=tc.arguments))
                for tc in calls] or None)
            choice = P.ChatChoice(index=c.index, message=message, finish_reason=finish, stop_reason=c.stop_reason,
                                  logprobs=self.chat_logprobs(c, num_top, req.return_tokens_as_token_ids)
                                  if req.logprobs else None,
                                  policy_versions=c.policy_versions, spec_decode_stats=c.spec_decode_stats,
                                  lora_versions=c.lora_versions)
            choice.routed_experts, choice.routed_experts_shape = _routed(c.routed_experts)
            if req.return_token_ids:
                choice.token_ids = c.token_ids
            choices.append(choice)
        response = P.ChatCompletionResponse(
            id=rid, created=int(time.time()), model=self.model_name(req), choices=choices,
            usage=_usage(len(ids), completion_tokens, out.num_cached_prompt_tokens))
        if req.return_token_ids:
            response.prompt_token_ids = ids
        if req.prompt_logprobs is not None:
            response.prompt_logprobs = self.prompt_logprobs(ids, score, req.prompt_logprobs)
        return _json(response)

    async def _stream_chat(self, request, req, rid, ids, params, parse_tools, num_top, release, lora) -> Response:
        streams = _Streams(self.engine, [(ids, params, rid)])

        async def start():
            score = None if req.prompt_logprobs is None else await self.score(ids, req.prompt_logprobs, lora)
            await streams.first()
            return score

        score = await self._open(request, rid, streams, start(), release)
        first_extras = {"prompt_token_ids": ids if req.return_token_ids else None,
                        "prompt_logprobs": None if score is None else self.prompt_logprobs(ids, score,
                                                                                           req.prompt_logprobs)}

        async def events():
            created = int(time.time())

            def chunk(choice: P.ChatStreamChoice, **extra) -> bytes:
                return _event(P.ChatCompletionChunk(id=rid, created=created, model=self.model_name(req),
                                                    choices=[choice], **extra))

            streamers = {}
            num_calls = [0] * req.n
            completion_tokens = cached = 0
            for j in range(req.n):  # the role first, as OpenAI streams it
                yield chunk(P.ChatStreamChoice(index=j, delta=P.ChatDelta(role="assistant", content="")),
                            **(first_extras if j == 0 else {}))
            async for _, out in streams:
                cached = out.num_cached_prompt_tokens
                for c in out.outputs:
                    j = c.index
                    completion_tokens += len(c.token_ids)
                    if parse_tools:
                        streamer = streamers.get(j)
                        if streamer is None:
                            streamer = streamers[j] = self.tool_parser.streamer()
                        pieces = streamer.feed(c.text or "") + (streamer.finish() if c.finished else [])
                    else:
                        pieces = [("content", c.text)] if c.text else []
                    content = "".join(p for kind, p in pieces if kind == "content")
                    calls = []
                    for kind, tc in pieces:
                        if kind == "tool_call":
                            calls.append(P.ToolCallDelta(index=num_calls[j], id=tc.id,
                                                         function=P.FunctionCallOut(name=tc.name,
                                                                                    arguments=tc.arguments)))
                            num_calls[j] += 1
                    finish = None
                    if c.finished:
                        finish = "tool_calls" if num_calls[j] and c.finish_reason == "stop" else c.finish_reason
                    choice = P.ChatStreamChoice(
                        index=j, delta=P.ChatDelta(content=content or None, tool_calls=calls or None),
                        finish_reason=finish, stop_reason=c.stop_reason if c.finished else None,
                        logprobs=self.chat_logprobs(c, num_top, req.return_tokens_as_token_ids)
                        if req.logprobs else None,
                        policy_versions=c.policy_versions, lora_versions=c.lora_versions,
                        spec_decode_stats=c.spec_decode_stats if c.finished else None)
                    choice.routed_experts, choice.routed_experts_shape = _routed(c.routed_experts)  # the last delta's
                    if req.return_token_ids:
                        choice.token_ids = c.token_ids
                    yield chunk(choice)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _event(P.ChatCompletionChunk(
                    id=rid, created=created, model=self.model_name(req), choices=[],
                    usage=_usage(len(ids), completion_tokens, cached)))

        return self._event_stream(events(), rid, streams, release)

    async def generate(self, request: Request) -> Response:
        req: P.GenerateRequest = await self.parse(request, P.GenerateRequest)
        sp = req.sampling_params or P.SGLangSamplingParams()
        max_tokens = self.bounded_default(sp, "max_new_tokens")
        self.check_common(sp.n, req.cache_salt, sp.stop_token_ids, max_tokens, "sampling_params.max_new_tokens")
        self.check_routed_experts(req.return_routed_experts)
        if req.input_embeds is not None:
            batched = isinstance(req.input_embeds[0][0], list)
            items = req.input_embeds if batched else [req.input_embeds]
            prompts = await self.embeds_prompts([lambda where, r=rows: _embeds_rows(r, where) for rows in items],
                                                "input_embeds", indexed=batched)
        else:
            field = "text" if req.text is not None else "input_ids"
            value = req.text if req.text is not None else req.input_ids
            batched = not (isinstance(value, str) or isinstance(value[0], int))
            items = list(value) if batched else [value]
            prompts = []
            for i, item in enumerate(items):
                param = f"{field}[{i}]" if batched else field
                ids = self.encode(item, True, param) if isinstance(item, str) else list(item)
                self.check_prompt(ids, param)
                prompts.append(ids)
        if req.rid is None:
            base = f"gen-{uuid.uuid4().hex}"
            rids = [f"{base}-{i}" for i in range(len(prompts))] if batched else [base]
        else:
            rids = [req.rid] if isinstance(req.rid, str) and not batched else req.rid
            if not isinstance(rids, list) or len(rids) != len(prompts):
                raise APIError(400, f"rid must be a string per prompt ({len(prompts)}), got {req.rid!r}", param="rid")
        loras = self.check_lora_path(req.lora_path, len(prompts))
        params = [self.sampling(
            n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
            max_tokens=max_tokens, min_tokens=sp.min_new_tokens,
            seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed, stop=_stops(sp.stop),
            stop_token_ids=sp.stop_token_ids or [], include_stop_str_in_output=sp.no_stop_trim,
            ignore_eos=sp.ignore_eos,
            top_logprobs=req.top_logprobs_num, skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens, cache_salt=req.cache_salt,
            return_routed_experts=req.return_routed_experts, lora=lora) for lora in loras]
        if req.stream and batched:
            raise APIError(400, "stream takes one prompt (send one /generate per prompt)", param="stream")
        release = self.admit(len(prompts))
        if req.stream:
            return await self._stream_generate(request, req, rids[0], prompts[0], params[0], release)
        try:
            outs, _ = await self.until_disconnect(request, rids[0], self.generate_all(prompts, params, rids))
        finally:
            release()
        results = [r for out, prompt in zip(outs, prompts) for r in self.sglang_result(out, req, _prompt_len(prompt))]
        return Response(json.dumps(results if batched or len(results) > 1 else results[0]),
                        media_type="application/json")

    def sglang_result(self, out: RequestOutput, req: P.GenerateRequest, num_prompt_tokens: int) -> list[dict]:
        """One SGLang result per sample of a prompt (of `num_prompt_tokens` tokens)."""
        results = []
        for c in out.outputs:
            finish: dict[str, Any] = {"type": c.finish_reason}
            if c.finish_reason == "length":
                finish["length"] = len(c.token_ids)
            if c.stop_reason is not None:
                finish["matched"] = c.stop_reason
            meta = {"id": f"{out.request_id}-{c.index}", "finish_reason": finish,
                    "prompt_tokens": num_prompt_tokens, "completion_tokens": len(c.token_ids),
                    "cached_tokens": out.num_cached_prompt_tokens, "policy_versions": c.policy_versions,
                    "weight_version": str(c.policy_versions[-1] if c.policy_versions
                                          else self.engine.engine.policy_version)}
            if c.spec_decode_stats is not None:
                meta["spec_decode_stats"] = c.spec_decode_stats
            if c.routed_experts is not None:  # streamed: the last result only
                meta["routed_experts"] = _routed(c.routed_experts)[0]
            if c.lora_versions is not None:
                meta["lora_versions"] = c.lora_versions
            if req.return_logprob:
                text = self.token_text if req.return_text_in_logprobs else (lambda t: None)
                meta["output_token_logprobs"] = [[_finite(lp), t, text(t)]
                                                 for lp, t in zip(c.logprobs or [], c.token_ids)]
                if req.top_logprobs_num:
                    meta["output_top_logprobs"] = [[[_finite(lp), t, text(t)] for t, lp in top]
                                                   for top in c.top_logprobs or []]
            results.append({"text": c.text, "output_ids": c.token_ids, "meta_info": meta})
        return results

    async def _stream_generate(self, request, req, rid, ids, params, release) -> Response:
        """SGLang's stream: after every step that gave tokens, the result so far (cumulative, as SGLang streams
        by default), a list of one result per sample when n > 1, then [DONE]."""
        streams = _Streams(self.engine, [(ids, params, rid)])
        await self._open(request, rid, streams, streams.first(), release)
        n = params.n
        text = "" if self.tokenizer is not None else None

        async def events():
            prompt_ids = None if isinstance(ids, dict) else ids  # an embedding prompt has none
            so_far = RequestOutput(request_id=rid, prompt=None, prompt_token_ids=prompt_ids, outputs=[
                CompletionOutput(index=j, token_ids=[], logprobs=None, finish_reason=None, policy_versions=[],
                                 text=text) for j in range(n)])
            async for _, out in streams:
                so_far.add(out)
                results = self.sglang_result(so_far, req, _prompt_len(ids))
                yield _event(results if n > 1 else results[0])

        return self._event_stream(events(), rid, streams, release)

    # ---- control endpoints --------------------------------------------------------------------------------------
    async def abort(self, request: Request) -> Response:
        req: P.AbortRequest = await self.parse(request, P.AbortRequest)
        if req.abort_all:
            return Response(json.dumps({"success": True, "num_aborted": await self.engine.abort_all()}),
                            media_type="application/json")
        return Response(json.dumps({"success": await self.engine.abort(req.rid)}), media_type="application/json")

    async def pause_generation(self, request: Request) -> Response:
        mode = (await self.parse(request, P.PauseGenerationRequest)).mode if _has_body(request) else "abort"
        await self.engine.pause()  # first: nothing steps once the aborts below are done
        self.paused = True
        if mode == "abort":
            await self.engine.abort_all()
        return Response(json.dumps({"status": "ok", "message": f"generation paused ({mode})"}),
                        media_type="application/json")

    async def continue_generation(self, request: Request) -> Response:
        """Steps again; a push staged while paused is applied first, and its outcome is in the answer
        (`weight_update`: the result, or `{"success": false, "error"}` with the old weights kept)."""
        body: dict[str, Any] = {"status": "ok", "message": "generation continued"}
        if self.span is not None:
            try:
                result = await self.end_span()
            except APIError as e:
                body["weight_update"] = {"success": False, "error": e.message}
            else:
                body["weight_update"] = {"success": True, "weight_version": str(result.version), **result.to_json()}
        await self.engine.resume()
        self.paused = False
        return Response(json.dumps(body), media_type="application/json")

    async def get_weight_version(self, request: Request) -> Response:
        version = await self._call(lambda e: e.policy_version)
        return Response(json.dumps({"weight_version": str(version)}), media_type="application/json")

    async def health_generate(self, request: Request) -> Response:
        """One greedy token through the engine (SGLang's probe); while paused at once (nothing steps), while asleep
        once the engine's thread answers."""
        if self.paused or await self._call(lambda e: e.is_sleeping):
            return Response(b'{"status":"ok"}', media_type="application/json")
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        await self._generate_one([0], params, f"health-{uuid.uuid4().hex}")
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def _generate_one(self, ids: list[int], params: SamplingParams, rid: str) -> RequestOutput:
        try:
            return await self.engine.generate(ids, params, request_id=rid)
        except BaseException as e:
            raise _engine_error(e) from None

    async def loads(self, request: Request) -> Response:
        """SGLang's /v1/loads as slime polls it until a server is idle: the requests running and waiting."""
        counts = await self._call(lambda e: (len(e.scheduler.running), len(e.scheduler.waiting)))
        running, waiting = counts
        return Response(json.dumps({"loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                                               "num_reqs": running + waiting}]}), media_type="application/json")

    async def server_info(self, request: Request) -> Response:
        eng = self.engine.engine
        version = await self._call(lambda e: e.policy_version)
        return Response(json.dumps({
            "model_path": self.model_path, "served_model_name": self.served_model_name,
            "weight_version": str(version), "policy_version": version, "max_model_len": self.max_model_len,
            "max_num_seqs": eng.config.max_num_seqs, "dtype": str(eng.config.dtype),
            "tp_size": eng.config.tensor_parallel_size, "dp_size": 1, "pp_size": 1,
            "ep_size": eng.config.tensor_parallel_size if eng.config.expert_parallel else 1,
            "host": self.config.host, "port": self.config.port, "block_size": eng.config.block_size,
            "num_kv_blocks": eng.num_kv_blocks, "num_preemptions": eng.scheduler.stats.num_preemptions,
            "is_paused": self.paused,
            "weight_update_groups": sorted(self.groups), "max_n": self.config.max_n,
            "max_pending_requests": self.config.max_pending_requests}), media_type="application/json")

    async def flush_cache(self, request: Request) -> Response:
        await self.engine.call(lambda e: e.kv_manager.reset_prefix_cache())
        return _success()

    async def release_memory(self, request: Request) -> Response:
        tags = (await self.parse(request, P.MemoryRequest)).tags if _has_body(request) else None
        await self._call(lambda e: e.sleep(2 if tags is None or "weights" in tags else 1))
        return _success()

    async def resume_memory(self, request: Request) -> Response:
        tags = (await self.parse(request, P.MemoryRequest)).tags if _has_body(request) else None
        await self._call(lambda e: e.wake_up(tags))
        return _success()

    async def update_weights_from_disk(self, request: Request) -> Response:
        req: P.UpdateWeightsFromDiskRequest = await self.parse(request, P.UpdateWeightsFromDiskRequest)
        version = req.version if req.weight_version is None else _weight_version(req.weight_version)
        if req.abort_all_requests:
            await self.engine.abort_all()

        def load(e):
            result = e.load_weights(req.model_path, version)
            if req.flush_cache:
                e.kv_manager.reset_prefix_cache()
            return result

        result = await self._call(load)
        return _updated(result)

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: a 200 with its plain-text success line, or an error in OpenAI's shape (400: the engine refused)."""
        req: P.LoadLoraAdapterRequest = await self.parse(request, P.LoadLoraAdapterRequest)
        if req.lora_name == self.served_model_name:
            raise APIError(400, f"lora_name {req.lora_name!r} is the served model's name; choose another",
                           param="lora_name")
        def load(e):
            e.load_lora(req.lora_name, req.lora_path)
            return e.list_loras()

        self._set_loras(await self._call(load))
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's: a 200 with its plain-text success line; 404 for a name not loaded, 400 while it is in use."""
        req: P.UnloadLoraAdapterRequest = await self.parse(request, P.UnloadLoraAdapterRequest)

        def unload(e):
            if all(info.name != req.lora_name for info in e.list_loras()):
                return None
            e.unload_lora(req.lora_name)
            return e.list_loras()

        loaded = await self._call(unload)
        if loaded is None:
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name",
                           code="lora_not_found")
        self._set_loras(loaded)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

    def _set_loras(self, loaded) -> None:
        self.loras = {info.name: info for info in loaded}

    async def init_weights_update_group(self, request: Request) -> Response:
        from weight_updates.transports.sglang_dist import init_custom_process_group

        req: P.InitWeightsUpdateGroupRequest = await self.parse(request, P.InitWeightsUpdateGroupRequest)
        if req.group_name in self.groups:
            raise APIError(400, f"group_name {req.group_name!r} is already joined; destroy it first",
                           param="group_name")
        if req.backend == "nccl" and await self._call(lambda e: e.weight_sink().device.type) != "cuda":
            raise APIError(400, "backend 'nccl' needs the weights on a CUDA device; this engine's are on the CPU: "
                                "use 'gloo'", param="backend")
        self.groups[req.group_name] = None  # reserved while joining
        try:
            group = await asyncio.to_thread(
                init_custom_process_group, backend=req.backend,
                init_method=f"tcp://{req.master_address}:{req.master_port}", world_size=req.world_size,
                rank=req.rank_offset, group_name=req.group_name, timeout=self._group_timeout())
        except Exception as e:
            del self.groups[req.group_name]
            raise APIError(400, f"could not join the weight update group {req.group_name!r} at "
                                f"{req.master_address}:{req.master_port}: {e}") from None
        self.groups[req.group_name] = group
        return Response(json.dumps({"success": True, "message": f"joined {req.group_name!r} as rank "
                                                                f"{req.rank_offset} of {req.world_size}"}),
                        media_type="application/json")

    async def update_weights_from_distributed(self, request: Request) -> Response:
        from weight_updates.transports.protocol import serve_session
        from weight_updates.transports.sglang_dist import BroadcastSource, destroy_process_group, parse_dtype

        req: P.UpdateWeightsFromDistributedRequest = await self.parse(request, P.UpdateWeightsFromDistributedRequest)
        group = self.groups.get(req.group_name)
        if group is None:
            raise APIError(400, f"group_name {req.group_name!r} is not joined (POST /init_weights_update_group "
                                "first)", param="group_name")
        version = None if req.weight_version is None else _weight_version(req.weight_version)
        try:
            dtypes = None if req.dtypes is None else [parse_dtype(d) for d in req.dtypes]
        except ValueError as e:
            raise APIError(400, str(e), param="dtypes") from None
        if req.abort_all_requests:
            await self.engine.abort_all()
        if self.span is not None and (self.span.group_name != req.group_name or version is None
                                      or version != self.span.version):
            await self._end_span_quietly()  # another update begins: the staged one is applied (or refused) first
        if self.paused and version is not None:
            return await self.span_call(req, group, version, dtypes)
        source = None

        def update(e):
            nonlocal source
            sink = e.weight_sink()
            source = BroadcastSource(group, version=e.policy_version + 1 if version is None else version,
                                     names=req.names, device=sink.device, dtypes=dtypes, shapes=req.shapes,
                                     buckets=None if req.buckets is None else [b.model_dump() for b in req.buckets])
            result = serve_session(sink, source)
            if req.flush_cache:
                e.kv_manager.reset_prefix_cache()
            return result

        try:
            result = await self.engine.call(update)
        except BaseException as e:
            if source is not None and source.broken:
                self.groups.pop(req.group_name, None)
                await asyncio.to_thread(destroy_process_group, group)
            raise _engine_error(e) from None
        return _updated(result)

    async def span_call(self, req, group, version: int, dtypes) -> Response:
        """One call of a push made while paused: its records are staged in the update of `version` (opened by its
        first call, on the engine's thread, which takes every call's broadcasts until /continue_generation)."""
        from weight_updates.transports.protocol import serve_session
        from weight_updates.transports.sglang_dist import Call, SpanningSource

        if self.span is None:
            specs = await self._call(lambda e: e.weight_specs())
            device = await self._call(lambda e: e.weight_sink().device)
            source = SpanningSource(group, version=version, specs=specs, device=device,
                                    timeout_s=self.config.weight_group_timeout_s)

            def run(e):
                result = serve_session(e.weight_sink(), source)
                if span.flush_cache:
                    e.kv_manager.reset_prefix_cache()
                return result

            span = _Span(group_name=req.group_name, version=version, source=source,
                         task=asyncio.ensure_future(self.engine.call(run)))
            self.span = span
        span = self.span
        span.flush_cache = span.flush_cache or req.flush_cache
        loop = asyncio.get_running_loop()
        answered: asyncio.Future = loop.create_future()
        span.source.submit(Call(names=req.names, dtypes=dtypes, shapes=req.shapes,
                                buckets=None if req.buckets is None else [b.model_dump() for b in req.buckets],
                                answer=lambda error: loop.call_soon_threadsafe(_settle_once, answered, error)))
        done, _ = await asyncio.wait({answered, span.task}, return_when=asyncio.FIRST_COMPLETED)
        error = answered.result() if answered in done else None
        if answered not in done:  # the session ended before answering this call (it broke, or timed out)
            error = self._span_failure(span) or "the staged update ended"
        if error is not None:  # the span stays open: its later calls are refused too, /continue_generation says why
            raise APIError(400, f"weight update to version {version} refused, nothing written: {error}")
        return Response(json.dumps({"success": True, "message": f"staged for version {version}; applied at "
                                                                "/continue_generation", "weight_version": str(version),
                                    "staged_bytes": span.source.nbytes}), media_type="application/json")

    async def end_span(self):
        """Apply the staged update (the session validates, writes and publishes) or raise its refusal (APIError)."""
        span = self.span
        span.source.end()
        try:
            return await span.task
        except BaseException as e:
            raise _engine_error(e) from None
        finally:
            await self._close_span(span)

    async def _end_span_quietly(self) -> None:
        try:
            await self.end_span()
        except APIError as e:
            logger.warning("a staged weight update was refused: %s", e.message)

    def _span_failure(self, span: "_Span") -> str | None:
        e = span.task.exception() if span.task.done() and not span.task.cancelled() else None
        return None if e is None else str(e)

    async def _close_span(self, span: "_Span") -> None:
        from weight_updates.transports.sglang_dist import destroy_process_group

        if self.span is span:
            self.span = None
        if span.source.broken and span.group_name in self.groups:
            await asyncio.to_thread(destroy_process_group, self.groups.pop(span.group_name))

    async def destroy_weights_update_group(self, request: Request) -> Response:
        from weight_updates.transports.sglang_dist import destroy_process_group

        name = (await self.parse(request, P.DestroyWeightsUpdateGroupRequest)).group_name if _has_body(request) \
            else "weight_update_group"
        if self.span is not None and self.span.group_name == name:
            await self._end_span_quietly()  # what it staged is applied (or refused) before the group goes
        group = self.groups.get(name)
        if group is None:
            raise APIError(400, f"group_name {name!r} is not joined", param="group_name")
        del self.groups[name]
        await asyncio.to_thread(destroy_process_group, group)
        return _success()

    def _group_timeout(self):
        from datetime import timedelta

        return timedelta(seconds=self.config.weight_group_timeout_s)

    async def _call(self, fn):
        try:
            return await self.engine.call(fn)
        except BaseException as e:
            raise _engine_error(e) from None


def _has_body(request: Request) -> bool:
    declared = request.headers.get("content-length")
    return request.headers.get("transfer-encoding") == "chunked" or (declared is not None and declared != "0")


class _Span:
    """A push made while paused: its calls stage records in one session running on the engine's thread."""

    def __init__(self, *, group_name: str, version: int, source, task: asyncio.Future) -> None:
        self.group_name, self.version, self.source, self.task = group_name, version, source, task
        self.flush_cache = False  # any call asked for it: flush once the update is applied


def _settle_once(future: asyncio.Future, error: str | None) -> None:
    if not future.done():
        future.set_result(error)


def _weight_version(text: str) -> int:
    """SGLang's weight_version string as the engine's policy version; 400 naming the field otherwise."""
    if not text.isascii() or not text.isdigit():
        raise APIError(400, f"weight_version must be a decimal integer string such as \"7\", got {text!r}",
                       param="weight_version")
    return int(text)


def _updated(result) -> Response:
    """SGLang's answer to a weight update ({"success", "message"}), with this engine's result and the version."""
    return Response(json.dumps({"success": True, "message": f"updated to version {result.version}",
                                "weight_version": str(result.version), **result.to_json()}),
                    media_type="application/json")


def _success() -> Response:
    return Response(b'{"success":true}', media_type="application/json")


def _engine_error(e: BaseException) -> BaseException:
    """What an engine failure is answered with: the engine's ValueError (a request it refused) is a 400."""
    if isinstance(e, (APIError, _Disconnected, asyncio.CancelledError)):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, RuntimeError):
        return APIError(503, f"the engine is not running: {e}", code="engine_stopped")
    return e


def _stream_error(e: Exception) -> bytes:
    e = _engine_error(e)
    if isinstance(e, APIError):
        return b"data: " + _error_body(e.status, e.message, e.param, e.code) + b"\n\n"
    logger.exception("stream failed", exc_info=e)
    return b"data: " + _error_body(500, "internal server error") + b"\n\n"


def build_app(engine: AsyncEngine, config: ServerConfig):
    """The FastAPI application serving `engine` as `config` says (its chat template and tool parser loaded now)."""
    from fastapi import FastAPI

    server = _Server(engine, config)
    app = FastAPI(title="rollout", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    routes = [("/health", server.health, ["GET"]), ("/v1/models", server.models, ["GET"]),
              ("/v1/models/{model:path}", server.model, ["GET"]),
              ("/v1/completions", server.completions, ["POST"]),
              ("/v1/chat/completions", server.chat_completions, ["POST"]),
              ("/generate", server.generate, ["POST"]), ("/get_model_info", server.model_info, ["GET"]),
              ("/get_weight_version", server.get_weight_version, ["GET"]),
              ("/health_generate", server.health_generate, ["GET"]),
              ("/server_info", server.server_info, ["GET"]), ("/get_server_info", server.server_info, ["GET"]),
              ("/v1/loads", server.loads, ["GET"])]
    if config.enable_admin:
        routes += [("/abort_request", server.abort, ["POST"]), ("/flush_cache", server.flush_cache, ["GET", "POST"]),
                   ("/release_memory_occupation", server.release_memory, ["POST"]),
                   ("/resume_memory_occupation", server.resume_memory, ["POST"]),
                   ("/update_weights_from_disk", server.update_weights_from_disk, ["POST"]),
                   ("/v1/load_lora_adapter", server.load_lora_adapter, ["POST"]),
                   ("/v1/unload_lora_adapter", server.unload_lora_adapter, ["POST"]),
                   ("/pause_generation", server.pause_generation, ["POST"]),
                   ("/continue_generation", server.continue_generation, ["POST"]),
                   ("/init_weights_update_group", server.init_weights_update_group, ["POST"]),
                   ("/update_weights_from_distributed", server.update_weights_from_distributed, ["POST"]),
                   ("/destroy_weights_update_group", server.destroy_weights_update_group, ["POST"])]
    for path, endpoint, methods in routes:
        app.add_route(path, endpoint, methods=methods)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        message = e.message  # may quote the request (", got ..."): never the key, even if a client sent it there
        if config.api_key is not None:
            message = message.replace(config.api_key, "<the API key>")
        return _error_response(e.status, message, e.param, e.code, e.headers)

    @app.exception_handler(_Disconnected)
    async def disconnected(request, e):
        return Response(status_code=400)  # nobody reads it: the client is gone

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        if e.status_code == 404:
            return _error_response(404, f"no endpoint {request.url.path}", code="not_found")
        return _error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}")

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        logger.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return _error_response(500, "internal server error (see the server's log)")

    if config.api_key is not None:
        app.add_middleware(_ApiKey, api_key=config.api_key)
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; ValueError naming the address when it cannot be had (in use, no such
    interface)."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    # proto IPPROTO_TCP (not 0), so asyncio sets TCP_NODELAY on every accepted connection: without it a reused
    # keep-alive connection waits ~40 ms (Nagle against delayed ACKs) for each response's second write
    sock = socket.socket(info[0], info[1], info[2])
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def uvicorn_server(app, sock: socket.socket):
    """A uvicorn.Server for `app` on the bound `sock`: no access log and none of uvicorn's start-up lines (the
    caller logs one), keep-alive connections, a graceful shutdown that aborts what is still streaming."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_config=None, log_level="warning", access_log=False,
                            lifespan="off", timeout_keep_alive=30, timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def serve(engine: AsyncEngine, config: ServerConfig, *, sock: socket.socket | None = None) -> None:
    """Serve until interrupted (SIGINT / SIGTERM), then close the engine. Logs one line when it listens.
    `sock`: a socket `bind(config.host, config.port)` gave before the engine loaded (so that a port in use is
    an error before the model loads); by default it is bound here."""
    try:
        app = build_app(engine, config)
        sock = sock if sock is not None else bind(config.host, config.port)
        server = uvicorn_server(app, sock)
        host, port = sock.getsockname()[:2]
        logger.info("serving %s as %r on http://%s:%d (API key %s; admin endpoints %s)", app.state.server.model_path,
                    app.state.server.served_model_name, host, port,
                    "required" if config.api_key else "not required", "on" if config.enable_admin else "off")
        server.run(sockets=[sock])
    finally:
        engine.close()
