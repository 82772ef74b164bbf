"""The OpenAPI 3.1 description of the HTTP API, served at GET /openapi.json, generated from the
route table (routes.py): every route the server answers is in it, with its bodies' schemas
(schemas.py) and every status it answers with.
"""
from __future__ import annotations

from engine.serve.routes import ApiRoute, route_table
from engine.serve.schemas import ERROR

ERROR_TEXT = {400: "the request is invalid (the message says what to fix)", 401: "missing or wrong API key",
              403: "the Host header names another server (DNS rebinding guard)",
              404: "no such model", 408: "the body did not arrive in time", 413: "the body is over `max_body`",
              415: "the body is not application/json", 429: "the queue is full (`max_queue`)",
              500: "the server could not do it (the message says why)",
              503: "the model is loading, or every worker has stopped"}


def operation(route: ApiRoute) -> dict:
    op: dict = {"summary": route.summary}
    if route.keyed:
        op["security"] = [{"bearer": []}, {}]
    if route.request is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": route.request}}}
    responses = {str(status): {"description": text, "content": content}
                 for status, (text, content) in route.responses.items()}
    for status in route.errors:
        responses.setdefault(str(status), {"description": ERROR_TEXT[status],
                                           "content": {"application/json": {"schema": ERROR}}})
    op["responses"] = responses
    return op


def openapi_schema(model_names: list[str]) -> dict:
    paths: dict[str, dict] = {}
    for route in route_table(model_names):
        paths.setdefault(route.path, {})[route.method.lower()] = operation(route)
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokentop", "version": "1",
                 "description": "OpenAI-compatible completions over tokentop's engine, and what fleet routers "
                                "ask a worker. Errors are OpenAI's shape: {\"error\": {message, type, param, code}}."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "needed when the server has an `api_key`"}}},
        "paths": paths,
    }
