"""GET /openapi.json, and a fuzz run over it with schemathesis: each operation gets generated
requests, valid and invalid by the schema (its positive and negative modes). None may get a
5xx, an undocumented status or content type, or hang; afterwards the server still answers a
normal request and every KV page is back.

Seeded and bounded: TOKENTOP_FUZZ_EXAMPLES examples per operation (default 30; raise it for
a longer run), TOKENTOP_FUZZ_SEED (default 37). The outcome counts are printed at the end
(pytest -s shows them).
"""
from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, seed, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    status_code_conformance,
)

from engine.serve.openapi import openapi_schema
from engine.serve.routes import route_table
from tests.fixtures.tiny_gguf import write_tiny_model
from tests.serve_util import in_process_server
from tests.test_serve import wait_idle

EXAMPLES = int(os.environ.get("TOKENTOP_FUZZ_EXAMPLES", "30"))
SEED = int(os.environ.get("TOKENTOP_FUZZ_SEED", "37"))
MODEL = "tiny"                      # the served id of tiny.gguf
OUTCOMES: Counter = Counter()       # (method, path, status) -> requests

# POST /trace takes no body to fuzz, and each call would write a trace file
schema = schemathesis.openapi.from_dict(openapi_schema([MODEL])).exclude(path="/trace")


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("model") / f"{MODEL}.gguf")
    with in_process_server(path, ["cpu"], max_context=32) as s:   # short answers: many requests a second
        yield s


def test_the_served_schema_is_the_fuzzed_one(fuzz_server):
    _, http = fuzz_server
    served = httpx.get(http.url + "/openapi.json", timeout=10).json()
    assert served == openapi_schema([MODEL]) and served["openapi"].startswith("3.1")
    assert set(served["paths"]) == {r.path for r in route_table([MODEL])}


@pytest.mark.slow
@schema.parametrize()
@seed(SEED)
@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx_or_hangs(case, fuzz_server):
    _, http = fuzz_server
    response = case.call(base_url=http.url, timeout=30)
    OUTCOMES[case.method, case.path, response.status_code] += 1
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                             content_type_conformance])


def test_the_server_is_whole_after_the_fuzzing(fuzz_server):
    engine, http = fuzz_server
    r = httpx.post(http.url + "/v1/completions", json={"prompt": "still here", "max_tokens": 4, "ignore_eos": True},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    wait_idle(engine)                # nothing running or queued, every KV page free
    print(f"\nfuzzed {sum(OUTCOMES.values())} requests (seed {SEED}, {EXAMPLES} examples per operation):")
    for (method, path, status), n in sorted(OUTCOMES.items()):
        print(f"  {method:4} {path:22} {status}: {n}")
    assert OUTCOMES, "the fuzz test did not run"
