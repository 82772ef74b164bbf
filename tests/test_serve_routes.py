"""The route table (engine/serve/routes.py) is what the server answers and what its OpenAPI
document says: every served route is in the schema, and every route that needs the key
answers 401 without it (and not 401 with it), the open ones answer without it."""
from __future__ import annotations

import httpx
import pytest
from starlette.routing import Route

from engine.serve.openapi import openapi_schema
from tests.fixtures.tiny_gguf import write_tiny_model
from tests.serve_util import in_process_server

KEY = "s3cret"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf")
    with in_process_server(path, ["cpu"], max_context=64, api_key=KEY) as s:
        yield s


def served(http) -> set[tuple[str, str]]:
    return {(method, route.path) for route in http.api.app.routes if isinstance(route, Route)
            for method in route.methods - {"HEAD"}}


def test_every_served_route_is_in_the_schema_and_the_other_way(keyed_server):
    _, http = keyed_server
    schema = httpx.get(http.url + "/openapi.json", timeout=10).json()
    documented = {(method.upper(), path) for path, ops in schema["paths"].items() for method in ops}
    assert served(http) == documented
    assert len(documented) >= 16 and {("GET", "/snapshot"), ("POST", "/trace"), ("GET", "/get_load"),
                                      ("POST", "/v1/chat/completions/render")} <= documented
    assert schema == openapi_schema(["tiny"])


def test_every_keyed_route_answers_401_without_the_key(keyed_server):
    _, http = keyed_server
    keyed = [r for r in http.api.routes if r.keyed]
    assert {r.path for r in keyed} >= {"/v1/completions", "/snapshot", "/trace", "/server_info", "/model_info"}
    for route in keyed:
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = httpx.request(route.method, http.url + route.path, headers=headers, timeout=10,
                              json={} if route.method == "POST" else None)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (route.path, r.text)
        documented = openapi_schema(["tiny"])["paths"][route.path][route.method.lower()]
        assert "401" in documented["responses"] and documented["security"] == [{"bearer": []}, {}]


def test_open_routes_answer_without_the_key_and_keyed_ones_with_it(keyed_server):
    _, http = keyed_server
    for route in http.api.routes:
        if route.method != "GET":
            continue
        headers = {"authorization": f"Bearer {KEY}"} if route.keyed else {}
        r = httpx.get(http.url + route.path, headers=headers, timeout=30)
        assert r.status_code == 200, (route.path, r.text)
