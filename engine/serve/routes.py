"""The HTTP API's route table: each route's method, path, handler, whether it needs the API key,
and its request and response schema. The server (app.py) mounts it, checking the key from it in
one place; the OpenAPI document (openapi.py) is generated from it. A new route is one handler
and one line here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.serve import schemas as S


@dataclass(frozen=True)
class ApiRoute:
    method: str
    path: str
    handler: str                  # the OpenAIServer's attribute serving it ("router.get_load": its RouterApi's)
    keyed: bool                   # needs `Authorization: Bearer <api_key>` when the server has a key
    summary: str
    responses: dict               # status -> (description, {content type: schema})
    request: dict | None = None   # the JSON body's schema; None: no body
    errors: tuple[int, ...] = field(default=(403,))    # error statuses (OpenAI's error shape)


def _json(description: str, schema: dict | None = None) -> tuple[str, dict]:
    return description, {"application/json": {"schema": schema or {"type": "object"}}}


# the checks every body goes through (body.py, protocol.py), then the prompt's
BODY_ERRORS = (400, 401, 403, 408, 413, 415)
PROMPT_ERRORS = BODY_ERRORS + (404, 503)


def route_table(model_names: list[str]) -> tuple[ApiRoute, ...]:
    """Every route the server answers, in the order the OpenAPI document lists them."""
    s = S.Schemas(model_names)
    return (
        ApiRoute("POST", "/v1/completions", "completions", True, "continue a prompt",
                 s.generation(S.TEXT_CHOICE), s.completion, PROMPT_ERRORS + (429,)),
        ApiRoute("POST", "/v1/chat/completions", "chat", True, "answer a chat",
                 s.generation(S.CHAT_CHOICE), s.chat, PROMPT_ERRORS + (429,)),
        ApiRoute("GET", "/v1/models", "models", True, "the model this server serves",
                 {200: _json("a list of one model", s.models)}, errors=(401, 403)),
        ApiRoute("POST", "/tokenize", "tokenize", True,
                 "the prompt's token ids, as the completion endpoints would feed the model",
                 {200: _json("the count and the ids", S.TOKENS)}, s.tokenize, PROMPT_ERRORS),
        ApiRoute("GET", "/snapshot", "snapshot", True, "the engine's snapshot as versioned JSON (docs/snapshot.md)",
                 {200: _json("workers, requests' figures, latency percentiles, alerts", S.SNAPSHOT)},
                 errors=(401, 403)),
        ApiRoute("GET", "/health", "health", False, "200 once the model is loaded",
                 {200: _json("ready"), 503: _json("loading, or every worker stopped")}),
        ApiRoute("GET", "/metrics", "prometheus", False, "Prometheus metrics (vLLM's names where they exist)",
                 {200: ("the text exposition format", {"text/plain": {"schema": {"type": "string"}}})}),
        ApiRoute("POST", "/trace", "write_trace", True, "write the flight recorder's last window as a "
                 "Perfetto trace in the server's trace directory",
                 {200: _json("where it was written", S.TRACE)}, errors=(401, 403, 500)),
        ApiRoute("POST", "/v1/completions/render", "router.render_completion", True,
                 "a completion's prompts as vLLM's GenerateRequests, token ids included (vllm-router)",
                 {200: _json("one GenerateRequest a prompt", {"type": "array", "items": S.GENERATE_REQUEST})},
                 s.completion, PROMPT_ERRORS),
        ApiRoute("POST", "/v1/chat/completions/render", "router.render_chat", True,
                 "a chat as vLLM's GenerateRequest, token ids included (vllm-router)",
                 {200: _json("the GenerateRequest", S.GENERATE_REQUEST)}, s.chat, PROMPT_ERRORS),
        ApiRoute("GET", "/get_load", "router.get_load", False, "requests running and waiting (vllm-router)",
                 {200: _json("the load", S.LOAD)}),
        ApiRoute("GET", "/server_info", "router.server_info", True, "serving limits (SGLang's gateway)",
                 {200: _json("the server's facts", S.SERVER_INFO)}, errors=(401, 403)),
        ApiRoute("GET", "/get_server_info", "router.server_info", True, "as /server_info",
                 {200: _json("the server's facts", S.SERVER_INFO)}, errors=(401, 403)),
        ApiRoute("GET", "/model_info", "router.model_info", True, "the model file and type (SGLang's gateway)",
                 {200: _json("the model's facts", S.MODEL_INFO)}, errors=(401, 403)),
        ApiRoute("GET", "/get_model_info", "router.model_info", True, "as /model_info",
                 {200: _json("the model's facts", S.MODEL_INFO)}, errors=(401, 403)),
        ApiRoute("GET", "/openapi.json", "openapi", False, "this document",
                 {200: _json("OpenAPI 3.1")}),
    )
