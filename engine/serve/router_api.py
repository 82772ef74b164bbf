"""What fleet routers ask of a worker besides the OpenAI API, in the shapes they read.

* vllm-router (vllm-project/router) tokenizes a request for its cache-aware policy with the
  worker's `POST /v1/completions/render` and `POST /v1/chat/completions/render`, falling back
  to `/tokenize`. The answers are vLLM's (vllm/entrypoints/serve/render/serving.py): a list
  of GenerateRequest objects for a completion (one per prompt), one GenerateRequest for a chat
  (vllm/entrypoints/serve/disagg/protocol.py: request_id, token_ids, features, sampling_params,
  model, stream, stream_options, cache_salt, priority, kv_transfer_params). The token ids are
  exactly what /v1/completions or /v1/chat/completions would feed the model here.
* Its power-of-two policy polls `GET /get_load` and reads the integer field "load"
  (src/routers/http/router.rs, get_worker_load): the requests running and waiting here.
* SGLang's gateway (sgl-model-gateway, src/core/steps/worker/local/discover_metadata.rs)
  asks `/server_info` then `/get_server_info`, `/model_info` then `/get_model_info`, and takes
  model_id, model_path, served_model_name, dp_size and the serving limits from the first,
  model_path, tokenizer_path, model_type and architectures from the second.

Their routes are in routes.py: `/get_load` is open like /health and /metrics; the others need the
API key when one is set.
"""
from __future__ import annotations

import asyncio
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.serve import protocol as P

VERSION = "0.1.0"     # pyproject.toml's, reported as the server's version


class RouterApi:
    def __init__(self, server):
        self.server = server           # the OpenAIServer these routes extend
        self.engine = server.engine
        self._model_facts: dict | None = None

    # --- render ---------------------------------------------------------------------------
    async def render_completion(self, request: Request) -> Response:
        body = await self.server.read_json(request)
        if not isinstance(body, dict):
            raise P.ApiError(400, "the request body must be a JSON object")
        out = []
        for prompt in _prompts(body.get("prompt")):
            parsed = P.parse_completion({**body, "prompt": prompt} if "prompt" in body else body)
            out.append(self._generate_request("cmpl", parsed, await self.server.encode(parsed), body))
        return JSONResponse(out)

    async def render_chat(self, request: Request) -> Response:
        body = await self.server.read_json(request)
        parsed = P.parse_chat(body)
        return JSONResponse(self._generate_request("chatcmpl", parsed, await self.server.encode(parsed), body))

    def _generate_request(self, prefix: str, p: P.Parsed, ids: list[int], body: dict) -> dict:
        _, ctx = self.engine.capacity()
        return {
            "request_id": f"{prefix}-{uuid.uuid4().hex}",
            "token_ids": ids,
            "features": None,                      # text only: no multimodal features
            "sampling_params": sampling_params(p, _max_tokens(p, len(ids), ctx)),
            "model": p.model,
            "stream": p.stream,
            "stream_options": body.get("stream_options") if p.stream else None,
            "cache_salt": p.params.cache_salt,
            "priority": 0,
            "kv_transfer_params": None,
        }

    # --- load and server facts ----------------------------------------------------------------
    async def get_load(self, request: Request) -> Response:
        snap = self.engine.snapshot()
        load = self.engine.outstanding()      # submitted, not finished: queued here or on a worker
        running = min(load, sum(w.running for w in snap.workers))   # workers report a few times a second
        tokens = sum(w.pages_used * w.page_size for w in snap.workers)
        return JSONResponse({"load": load, "num_reqs": load, "num_waiting_reqs": load - running,
                             "num_tokens": tokens})

    async def server_info(self, request: Request) -> Response:
        facts = await self._facts()
        snap = self.engine.snapshot()
        capacity, ctx = self.engine.capacity()
        cfg = self.engine.config.workers[0]
        return JSONResponse({
            "model_id": self.server.model,
            "served_model_name": self.server.model,
            "model_path": facts["path"],
            "tokenizer_path": facts["path"],
            "dp_size": 1,             # one endpoint; this server routes among its own workers
            "version": VERSION,
            "context_length": ctx or None,
            "page_size": cfg.page_size,
            "max_running_requests": capacity,
            "max_num_reqs": capacity,
            "max_batch_size": capacity,
            "max_total_tokens": sum(w.pages_total * w.page_size for w in snap.workers if w.state == "ready"),
            "max_prefill_tokens": cfg.max_batched_tokens,
            "workers": [{"name": w.name, "device": w.device, "state": w.state} for w in snap.workers],
        })

    async def model_info(self, request: Request) -> Response:
        facts = await self._facts()
        return JSONResponse({"model_path": facts["path"], "tokenizer_path": facts["path"],
                             "served_model_name": self.server.model, "is_generation": True,
                             "model_type": facts["arch"], "architectures": None})

    async def _facts(self) -> dict:
        """The model file and its architecture, read once (the file's header, off the loop)."""
        if self._model_facts is None:
            self._model_facts = await asyncio.to_thread(_model_facts, self.engine.config.workers[0].model)
        return self._model_facts


def _model_facts(ref: str) -> dict:
    from engine.errors import TokentopError
    from engine.models.catalog import resolve_model
    from engine.models.gguf import load_gguf

    try:
        path = resolve_model(ref)
        arch = load_gguf(path).metadata.get("general.architecture")
    except (TokentopError, OSError, ValueError):
        return {"path": ref, "arch": None}
    return {"path": str(path), "arch": arch if isinstance(arch, str) else None}


def _prompts(prompt) -> list:
    """A completion's prompts: a list of texts or of token-id lists is one prompt each."""
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    return [prompt]


def _max_tokens(p: P.Parsed, n_prompt: int, ctx: int) -> int:
    """What /v1/completions and /v1/chat/completions would allow this request (same errors)."""
    room = ctx - n_prompt
    if room < 1:
        raise P.ApiError(400, f"the prompt has {n_prompt} tokens but the context is {ctx} tokens; "
                              "shorten the prompt", "messages" if p.kind == "chat" else "prompt",
                         code="context_length_exceeded")
    if p.max_tokens_given:
        name = p.max_tokens_given if isinstance(p.max_tokens_given, str) else "max_tokens"
        if p.params.max_tokens > room:
            raise P.ApiError(400, f"{name} {p.params.max_tokens} plus the prompt's {n_prompt} tokens "
                                  f"exceed the context of {ctx} tokens; ask for at most {room}", name,
                             code="context_length_exceeded")
        return p.params.max_tokens
    return min(16, room) if p.kind == "completion" else room


def sampling_params(p: P.Parsed, max_tokens: int) -> dict:
    """tokentop's sampling settings under vLLM's SamplingParams names (vllm/sampling_params.py)."""
    s = p.params
    return {
        "n": 1, "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty, "temperature": s.temperature, "top_p": s.top_p,
        "top_k": s.top_k, "min_p": s.min_p, "seed": s.seed, "stop": list(s.stop) or None,
        "stop_token_ids": list(s.stop_token_ids) or None, "ignore_eos": s.ignore_eos,
        "max_tokens": max_tokens, "min_tokens": 0,
        "logprobs": s.logprobs if p.logprobs else None, "prompt_logprobs": None,
        "skip_special_tokens": True, "spaces_between_special_tokens": True,
        "include_stop_str_in_output": False,
    }
