"""The OpenAPI 3.1 description of the HTTP API, served at GET /openapi.json.

Request fields and their JSON types come from protocol.py's field tables, their bounds from
SamplingParams' (engine/config.py): the schema says what the parser accepts, so a client (or
a fuzzer, tests/test_openapi_fuzz.py) can build requests from it.
"""
from __future__ import annotations

from engine import config as C
from engine.serve import protocol as P

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               dict: "object", type(None): "null"}

# field -> JSON Schema keywords beyond the type (the ranges SamplingParams.validate enforces)
_BOUNDS: dict[str, dict] = {
    "max_tokens": {"minimum": 1, "maximum": C.MAX_COUNT},
    "max_completion_tokens": {"minimum": 1, "maximum": C.MAX_COUNT},
    "temperature": {"minimum": 0, "description": f"0 = greedy; otherwise at least {C.MIN_TEMPERATURE:g}"},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "maximum": C.MAX_COUNT, "description": "0 or -1 = off"},
    "min_p": {"minimum": 0, "exclusiveMaximum": 1},
    "repetition_penalty": {"minimum": C.REPETITION_PENALTY_RANGE[0], "maximum": C.REPETITION_PENALTY_RANGE[1]},
    "presence_penalty": {"minimum": C.OPENAI_PENALTY_RANGE[0], "maximum": C.OPENAI_PENALTY_RANGE[1]},
    "frequency_penalty": {"minimum": C.OPENAI_PENALTY_RANGE[0], "maximum": C.OPENAI_PENALTY_RANGE[1]},
    "seed": {"minimum": C.SEED_RANGE[0], "maximum": C.SEED_RANGE[1]},
    "n": {"const": 1},
    "best_of": {"const": 1},
    "logprobs": {"minimum": 0, "maximum": 20},
    "top_logprobs": {"minimum": 0, "maximum": 20},
    "stop": {"items": {"type": "string", "minLength": 1, "maxLength": C.MAX_STOP_CHARS}, "maxItems": C.MAX_STOPS,
             "minLength": 1, "maxLength": C.MAX_STOP_CHARS},
    "stop_token_ids": {"items": {"type": "integer", "minimum": 0, "maximum": C.MAX_COUNT},
                       "maxItems": C.MAX_STOP_TOKEN_IDS},
    "cache_salt": {"minLength": 1},
    "speculate": {"enum": list(C.SPEC_MODES) + [None]},
    "spec_k": {"description": f"a draft length 0-16 or one of {', '.join(C.SPEC_K_POLICIES)}"},
    "spec_tv_budget": {"minimum": 0, "maximum": 1},
    "stream_options": {"properties": {"include_usage": {"type": "boolean"}}},
    "echo": {"enum": [False, None]},
    "suffix": {"enum": ["", None]},
}

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}

_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["system", "user", "assistant", "tool"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}}}

_PROMPT = {"oneOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
    {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}}]}

_USAGE = {"type": ["object", "null"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"}}}

_MS = {"type": ["number", "null"]}
_METRICS = {"type": "object", "description": "only with `per_request_metrics` (on the final usage "
            "chunk, or the last chunk, when streaming); milliseconds from the engine's record of the request",
            "properties": {
                **{name: _MS for name in ("queue_time_ms", "time_to_first_token_ms", "generation_time_ms",
                                          "mean_itl_ms", "e2e_latency_ms", "tokens_per_second")},
                "speculative_decoding": {"type": "object", "description": "when the request speculated",
                                         "properties": {
                    "mean_acceptance_length": {"type": "number"}, "draft_acceptance_rate": {"type": "number"},
                    "acceptance_histogram": {"type": "array", "items": {"type": "integer"}},
                    **{name: {"type": "integer"} for name in ("num_spec_steps", "num_accepted_draft_tokens",
                                                              "num_draft_tokens", "num_spec_tokens")}}}}}


def _field(name: str, types: tuple) -> dict:
    kinds = list(dict.fromkeys(_JSON_TYPES[t] for t in types))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, **_BOUNDS.get(name, {})}


def _request(fields: dict, required: str, **overrides) -> dict:
    props = {name: _field(name, types) for name, types in fields.items()}
    props.update(overrides)
    return {"type": "object", "required": [required], "properties": props}


def _errors(*codes: int) -> dict:
    text = {400: "the request is invalid (the message says what to fix)", 401: "missing or wrong API key",
            403: "the Host header names another server (DNS rebinding guard)",
            404: "no such model", 408: "the body did not arrive in time", 413: "the body is over `max_body`",
            415: "the body is not application/json", 429: "the queue is full (`max_queue`)",
            503: "the model is loading, or every worker has stopped"}
    return {str(c): {"description": text[c], "content": {"application/json": {"schema": _ERROR}}} for c in codes}


def _generation(summary: str, request: dict, choice: dict) -> dict:
    body = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
        "model": {"type": "string"}, "choices": {"type": "array", "items": choice}, "usage": _USAGE,
        "metrics": _METRICS}}
    return {"post": {
        "summary": summary, "security": [{"bearer": []}, {}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {"200": {"description": "the completion; with \"stream\": true, server-sent events "
                                             "of chunks ending with data: [DONE]",
                              "content": {"application/json": {"schema": body},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                      **_errors(400, 401, 403, 404, 408, 413, 415, 429, 503)}}}


def openapi_schema(model_names: list[str]) -> dict:
    completion = _request(P.COMPLETION_FIELDS, "prompt", prompt=_PROMPT,
                          model={"enum": model_names})
    chat = _request(P.CHAT_FIELDS, "messages", messages={"type": "array", "minItems": 1, "items": _MESSAGE},
                    model={"enum": model_names})
    tokenize = {"type": "object", "properties": {"model": {"enum": model_names}, "prompt": _PROMPT,
                                                 "messages": {"type": "array", "minItems": 1, "items": _MESSAGE}},
                "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
    text_choice = {"type": "object", "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                                    "finish_reason": {"type": ["string", "null"]}}}
    chat_choice = {"type": "object", "properties": {"index": {"type": "integer"},
                                                    "message": {"type": "object"},
                                                    "finish_reason": {"type": ["string", "null"]}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokentop", "version": "1",
                 "description": "OpenAI-compatible completions over tokentop's engine. Errors are OpenAI's "
                                "shape: {\"error\": {message, type, param, code}}."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "needed when the server has an `api_key`"}}},
        "paths": {
            "/v1/completions": _generation("continue a prompt", completion, text_choice),
            "/v1/chat/completions": _generation("answer a chat", chat, chat_choice),
            "/v1/models": {"get": {"summary": "the model this server serves", "security": [{"bearer": []}, {}],
                                   "responses": {"200": {"description": "a list of one model", "content": {
                                       "application/json": {"schema": {"type": "object", "properties": {
                                           "object": {"const": "list"},
                                           "data": {"type": "array", "items": {"type": "object", "properties": {
                                               "id": {"enum": model_names}}}}}}}}},
                                                 **_errors(401, 403)}}},
            "/tokenize": {"post": {
                "summary": "the prompt's token ids, as the completion endpoints would feed the model",
                "security": [{"bearer": []}, {}],
                "requestBody": {"required": True, "content": {"application/json": {"schema": tokenize}}},
                "responses": {"200": {"description": "the count and the ids", "content": {"application/json": {
                    "schema": {"type": "object", "required": ["count", "tokens"], "properties": {
                        "count": {"type": "integer"}, "tokens": {"type": "array", "items": {"type": "integer"}},
                        "max_model_len": {"type": ["integer", "null"]}}}}}},
                              **_errors(400, 401, 403, 404, 408, 413, 415, 503)}}},
            "/health": {"get": {"summary": "200 once the model is loaded", "responses": {
                "200": {"description": "ready", "content": {"application/json": {"schema": {"type": "object"}}}},
                "503": {"description": "loading, or every worker stopped",
                        "content": {"application/json": {"schema": {"type": "object"}}}},
                **_errors(403)}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (vLLM's names where they exist)", "responses": {
                "200": {"description": "the text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}}}, **_errors(403)}}},
            "/openapi.json": {"get": {"summary": "this document", "responses": {
                "200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}},
                **_errors(403)}}},
        },
    }
