"""HTTP front end over an `AsyncEngine`: SGLang's native `/generate` and a subset of OpenAI's
`/v1/completions`, so rollout code written against either can point at this engine.

    python -m rollout serve --model DIR [--host 127.0.0.1] [--port 30000] [--config engine.yaml]

    GET  /health                      200 {"status": "ok"}
    GET  /get_model_info              {"model_path", "policy_version", "has_tokenizer"}
    POST /generate                    {"input_ids" | "text", "sampling_params", "return_logprob", "rid"?,
                                      "stream"?}: one prompt or a list; one result per sample ({"text",
                                      "output_ids", "meta_info"}); "stream": server-sent events of one prompt,
                                      each the result so far (cumulative text, as SGLang streams by default)
    POST /abort_request               {"rid"}: that /generate call returns what it has, finish_reason "abort"
    POST /v1/completions              {"prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop",
                                      "seed", "logprobs"}: OpenAI's text_completion object
    GET|POST /flush_cache             empty the prefix cache (blocks in use stay in use)
    POST /release_memory_occupation   {"tags"?}: Engine.sleep (level 2 when the tags include "weights")
    POST /resume_memory_occupation    {"tags"?}: Engine.wake_up(tags)
    POST /update_weights_from_disk    {"model_path", "version"?}: Engine.load_weights, validated before writing

A request the engine refuses (bad sampling parameters, a prompt too long, the engine asleep) gets a 400
with {"error": message}; the server and the other requests go on. Every result carries the policy
version of each token (`meta_info["policy_versions"]`). Not here: streaming of /v1/completions, chat
templates, authentication, weight pushes of tensor data (use the weight_updates transports).
"""

from __future__ import annotations

import itertools
import json
import logging
import time

from rollout.async_engine import AsyncEngine
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# SGLang's sampling_params keys -> SamplingParams fields
_SGLANG_PARAMS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "temperature": "temperature",
                  "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop",
                  "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "n": "n",
                  "skip_special_tokens": "skip_special_tokens", "sampling_seed": "seed", "seed": "seed",
                  "no_stop_trim": "include_stop_str_in_output"}
_OPENAI_PARAMS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed", "logprobs", "model",
                  "ignore_eos", "min_tokens", "stop_token_ids"}


def sglang_params(raw: dict | None) -> SamplingParams:
    """SGLang `sampling_params` -> SamplingParams; ValueError naming an unknown key."""
    raw = dict(raw or {})
    unknown = sorted(set(raw) - set(_SGLANG_PARAMS))
    if unknown:
        raise ValueError(f"unknown sampling_params {unknown}; known: {sorted(_SGLANG_PARAMS)}")
    fields = {_SGLANG_PARAMS[k]: v for k, v in raw.items() if v is not None}
    fields.setdefault("max_tokens", 128)  # SGLang's default max_new_tokens
    return SamplingParams(**fields)


def _prompts(body: dict, text_key: str, ids_key: str | None) -> tuple[list, bool]:
    """(prompts, batched) from a request body: a text or token-id prompt, or a list of them."""
    value = body.get(ids_key) if ids_key is not None and body.get(ids_key) is not None else body.get(text_key)
    if value is None:
        raise ValueError(f"give {text_key!r}" + (f" or {ids_key!r}" if ids_key else ""))
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        return [value], False
    if isinstance(value, list) and value:
        return list(value), True
    raise ValueError(f"{text_key!r} must be a prompt or a non-empty list of prompts")


def _rids(rid, num_prompts: int, batched: bool) -> list[str] | None:
    """The request ids a client chose (`rid`: one string, or one per prompt of a batch), or None."""
    if rid is None:
        return None
    rids = [rid] if isinstance(rid, str) and not batched else rid
    if not isinstance(rids, list) or len(rids) != num_prompts or not all(isinstance(r, str) for r in rids):
        raise ValueError(f"'rid' must be a string per prompt ({num_prompts}), got {rid!r}")
    return rids


def sglang_result(out: RequestOutput, return_logprob: bool) -> list[dict]:
    """One SGLang result per sample of a prompt."""
    results = []
    for c in out.outputs:
        finish = {"type": c.finish_reason}
        if c.finish_reason == "length":
            finish["length"] = len(c.token_ids)
        if c.stop_reason is not None:
            finish["matched"] = c.stop_reason
        meta = {"id": f"{out.request_id}-{c.index}", "finish_reason": finish, "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": len(c.token_ids), "cached_tokens": out.num_cached_prompt_tokens,
                "policy_versions": c.policy_versions}
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs or [], c.token_ids)]
        results.append({"text": c.text, "output_ids": c.token_ids, "meta_info": meta})
    return results


def build_app(engine: AsyncEngine, model_path: str):
    """The aiohttp application serving `engine`."""
    import asyncio

    from aiohttp import web

    ids = itertools.count()

    def refused(e: Exception) -> web.Response:
        return web.json_response({"error": str(e)}, status=400)

    async def body_of(request) -> dict:
        try:
            body = await request.json()
        except ValueError as e:
            raise ValueError(f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        return body

    async def generate_all(prompts, params, rids):
        """Every prompt's finished output, in order; when one is refused, the others are cancelled (which
        aborts them) and its error raised."""
        tasks = [asyncio.ensure_future(engine.generate(p, params, request_id=r)) for p, r in zip(prompts, rids)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def tags_of(request) -> list | None:
        return (await body_of(request)).get("tags") if request.can_read_body else None

    async def health(request):
        return web.json_response({"status": "ok"})

    async def model_info(request):
        version = await engine.call(lambda e: e.policy_version)
        return web.json_response({"model_path": model_path, "policy_version": version,
                                  "has_tokenizer": engine.engine.tokenizer is not None})

    async def generate(request):
        try:
            body = await body_of(request)
            prompts, batched = _prompts(body, "text", "input_ids")
            params = sglang_params(body.get("sampling_params"))
            rids = _rids(body.get("rid"), len(prompts), batched) or [f"gen-{next(ids)}" for _ in prompts]
            if body.get("stream"):
                if batched:
                    raise ValueError("stream takes one prompt")
                return await stream(request, engine.stream(prompts[0], params, request_id=rids[0]), params.n,
                                    bool(body.get("return_logprob")))
            outs = await generate_all(prompts, params, rids)
        except (ValueError, TypeError) as e:  # TypeError: a field of the wrong JSON type
            return refused(e)
        results = [r for out in outs for r in sglang_result(out, bool(body.get("return_logprob")))]
        return web.json_response(results if batched or len(results) > 1 else results[0])

    async def stream(request, outputs, num_samples: int, return_logprob: bool):
        """Server-sent events: after every step that gave tokens, the result so far, then [DONE]. As SGLang's
        /generate streams by default (its --incremental-streaming-output off), each event is cumulative: the
        text so far (never null with a tokenizer; a partial character or a possible stop string's start
        waits for the next event, so every event's text is a prefix of the final one), output_ids and
        meta_info so far; a list of one result per sample when n > 1. The engine's delta outputs are folded
        into `so_far`. The first output is awaited before the response starts, so a refused request still
        gets its 400."""
        try:
            out = await outputs.__anext__()
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            text = "" if engine.engine.tokenizer is not None else None
            empty = [CompletionOutput(index=j, token_ids=[], logprobs=None, finish_reason=None, policy_versions=[],
                                      text=text) for j in range(num_samples)]
            so_far = RequestOutput(request_id=out.request_id, prompt=out.prompt, prompt_token_ids=out.prompt_token_ids,
                                   outputs=empty)
            while True:
                so_far.add(out)
                results = sglang_result(so_far, return_logprob)
                await response.write(f"data: {json.dumps(results if num_samples > 1 else results[0])}\n\n".encode())
                if out.finished:
                    break
                out = await outputs.__anext__()
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            await outputs.aclose()  # a client gone mid-stream aborts its request

    async def completions(request):
        try:
            body = await body_of(request)
            unknown = sorted(set(body) - _OPENAI_PARAMS - {"prompt"})
            if unknown:
                raise ValueError(f"unsupported completion fields {unknown}")
            prompts, _ = _prompts(body, "prompt", None)
            fields = {k: body[k] for k in _OPENAI_PARAMS - {"logprobs", "model"} if body.get(k) is not None}
            fields.setdefault("max_tokens", 16)  # OpenAI's default
            params = SamplingParams(**fields)
            outs = await generate_all(prompts, params, [f"cmpl-{next(ids)}" for _ in prompts])
        except (ValueError, TypeError) as e:  # TypeError: a field of the wrong JSON type
            return refused(e)
        tokenizer = engine.engine.tokenizer
        choices, completion_tokens = [], 0
        for out in outs:
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if body.get("logprobs") is not None:
                    tokens = [tokenizer.decode([t], False) for t in c.token_ids] if tokenizer is not None else None
                    logprobs = {"tokens": tokens, "token_logprobs": c.logprobs}
                choices.append({"index": len(choices), "text": c.text, "token_ids": c.token_ids, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                "policy_versions": c.policy_versions})
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        return web.json_response({
            "id": f"cmpl-{next(ids)}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or model_path, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        })

    async def abort(request):
        try:
            rid = (await body_of(request)).get("rid")
            if not isinstance(rid, str):
                raise ValueError("give 'rid', the id a /generate request was sent with")
        except ValueError as e:
            return refused(e)
        return web.json_response({"success": await engine.abort(rid)})

    async def flush_cache(request):
        await engine.call(lambda e: e.kv_manager.reset_prefix_cache())
        return web.json_response({"success": True})

    def memory_endpoint(act):
        """A handler that reads the request's tags and runs act(engine, tags) between engine steps."""
        async def handler(request):
            try:
                tags = await tags_of(request)
                await engine.call(lambda e: act(e, tags))
            except (ValueError, TypeError) as e:  # TypeError: a field of the wrong JSON type
                return refused(e)
            return web.json_response({"success": True})
        return handler

    release = memory_endpoint(lambda e, tags: e.sleep(2 if tags is None or "weights" in tags else 1))
    resume = memory_endpoint(lambda e, tags: e.wake_up(tags))

    async def update_from_disk(request):
        try:
            body = await body_of(request)
            path = body.get("model_path")
            if not isinstance(path, str):
                raise ValueError("give 'model_path', a checkpoint directory")
            result = await engine.call(lambda e: e.load_weights(path, body.get("version")))
        except (ValueError, TypeError) as e:  # TypeError: a field of the wrong JSON type
            return refused(e)
        return web.json_response({"success": True, **result.to_json()})

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/get_model_info", model_info),
                    web.post("/generate", generate), web.post("/v1/completions", completions),
                    web.post("/abort_request", abort), web.route("*", "/flush_cache", flush_cache),
                    web.post("/release_memory_occupation", release), web.post("/resume_memory_occupation", resume),
                    web.post("/update_weights_from_disk", update_from_disk)])
    return app


def serve(engine: AsyncEngine, model_path: str, host: str, port: int) -> None:
    """Serve until interrupted, then close the engine."""
    from aiohttp import web

    try:
        web.run_app(build_app(engine, model_path), host=host, port=port, print=logger.info)
    finally:
        engine.close()
