"""The JSON schemas of the HTTP API's bodies, for its route table (routes.py) and so its OpenAPI
document (openapi.py).

Request fields and their JSON types come from protocol.py's field tables, their bounds from
SamplingParams' (engine/config.py): a schema says what the parser accepts, so a client (or a
fuzzer, tests/test_openapi_fuzz.py) can build requests from it.
"""
from __future__ import annotations

from engine import config as C
from engine.serve import protocol as P

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               dict: "object", type(None): "null"}

# field -> JSON Schema keywords beyond the type (the ranges SamplingParams.validate enforces)
BOUNDS: dict[str, dict] = {
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

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}

MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["system", "user", "assistant", "tool"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}}}

PROMPT = {"oneOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
    {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}}]}

USAGE = {"type": ["object", "null"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"}}}

MS = {"type": ["number", "null"]}
METRICS = {"type": "object", "description": "only with `per_request_metrics` (on the final usage "
           "chunk, or the last chunk, when streaming); milliseconds from the engine's record of the request",
           "properties": {
               **{name: MS for name in ("queue_time_ms", "time_to_first_token_ms", "generation_time_ms",
                                        "mean_itl_ms", "e2e_latency_ms", "tokens_per_second")},
               "speculative_decoding": {"type": "object", "description": "when the request speculated",
                                        "properties": {
                   "mean_acceptance_length": {"type": "number"}, "draft_acceptance_rate": {"type": "number"},
                   "acceptance_histogram": {"type": "array", "items": {"type": "integer"}},
                   **{name: {"type": "integer"} for name in ("num_spec_steps", "num_accepted_draft_tokens",
                                                             "num_draft_tokens", "num_spec_tokens")}}}}}


def field_schema(name: str, types: tuple) -> dict:
    kinds = list(dict.fromkeys(JSON_TYPES[t] for t in types))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, **BOUNDS.get(name, {})}


def request_schema(fields: dict, required: str, **overrides) -> dict:
    props = {name: field_schema(name, types) for name, types in fields.items()}
    props.update(overrides)
    return {"type": "object", "required": [required], "properties": props}


TEXT_CHOICE = {"type": "object", "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                                "finish_reason": {"type": ["string", "null"]}}}
CHAT_CHOICE = {"type": "object", "properties": {"index": {"type": "integer"}, "message": {"type": "object"},
                                                "finish_reason": {"type": ["string", "null"]}}}
TOKENS = {"type": "object", "required": ["count", "tokens"], "properties": {
    "count": {"type": "integer"}, "tokens": {"type": "array", "items": {"type": "integer"}},
    "max_model_len": {"type": ["integer", "null"]}}}
SNAPSHOT = {"type": "object", "required": ["version", "workers", "requests"], "properties": {
    "version": {"type": "integer"}, "workers": {"type": "array", "items": {"type": "object"}},
    "requests": {"type": "array", "items": {"type": "object"}}, "latency": {"type": "object"},
    "alerts": {"type": "array"}}}
TRACE = {"type": "object", "required": ["path"], "properties": {"path": {"type": "string"}}}
GENERATE_REQUEST = {"type": "object", "required": ["request_id", "token_ids", "sampling_params"], "properties": {
    "request_id": {"type": "string"}, "token_ids": {"type": "array", "items": {"type": "integer"}},
    "sampling_params": {"type": "object"}}}
LOAD = {"type": "object", "required": ["load"], "properties": {
    "load": {"type": "integer"}, "num_reqs": {"type": "integer"}, "num_waiting_reqs": {"type": "integer"},
    "num_tokens": {"type": "integer"}}}
SERVER_INFO = {"type": "object", "required": ["model_id"], "properties": {
    "model_id": {"type": "string"}, "model_path": {"type": "string"}, "dp_size": {"type": "integer"},
    "context_length": {"type": ["integer", "null"]}, "max_running_requests": {"type": "integer"}}}
MODEL_INFO = {"type": "object", "required": ["model_path"], "properties": {
    "model_path": {"type": "string"}, "model_type": {"type": ["string", "null"]}}}


class Schemas:
    """The schemas that name the served models."""

    def __init__(self, model_names: list[str]) -> None:
        self.completion = request_schema(P.COMPLETION_FIELDS, "prompt", prompt=PROMPT, model={"enum": model_names})
        self.chat = request_schema(P.CHAT_FIELDS, "messages", model={"enum": model_names},
                                   messages={"type": "array", "minItems": 1, "items": MESSAGE})
        self.tokenize = {"type": "object", "properties": {
            "model": {"enum": model_names}, "prompt": PROMPT,
            "messages": {"type": "array", "minItems": 1, "items": MESSAGE}},
            "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
        self.models = {"type": "object", "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"type": "object", "properties": {"id": {"enum": model_names}}}}}}

    @staticmethod
    def generation(choice: dict) -> dict:
        """A completion's 200: the whole answer as JSON, or server-sent events when streamed."""
        body = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
            "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "choices": {"type": "array", "items": choice}, "usage": USAGE,
            "metrics": METRICS}}
        return {200: ("the completion; with \"stream\": true, server-sent events of chunks ending with "
                      "data: [DONE]", {"application/json": {"schema": body},
                                       "text/event-stream": {"schema": {"type": "string"}}})}
