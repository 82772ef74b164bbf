"""`bench batching --llama-server`: the launcher, the shared HTTP client and the side-by-side
table. Without a llama-server binary the comparison runs between two tokentop servers on a
tiny model (simulated workers); with LLAMA_SERVER=/path/to/llama-server (shared/models.md
says how to build it) the real comparison runs too, briefly."""
from __future__ import annotations

import os
import sys
import textwrap

import pytest

from engine.bench import llama_server as ls
from engine.config import WorkerConfig
from engine.facade.devices import parse_devices


def test_llama_server_command_line():
    assert ls.llama_server_argv("/b/llama-server", "/m/q.gguf", 18080, 2) == [
        "/b/llama-server", "-m", "/m/q.gguf", "-np", "8", "-c", "8192", "-t", "2",
        "--host", "127.0.0.1", "--port", "18080"]


FAKE_SERVER = textwrap.dedent('''
    """Answers like llama-server: /health is 503 while "loading" (the first 5 asks), then 200;
    /v1/completions gives max_tokens tokens, at most 30 (its context is short). Records its argv."""
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    args = sys.argv[1:]
    open(sys.argv[0] + ".argv", "w").write(json.dumps(args))
    asks = [0]
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def _send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def do_GET(self):
            asks[0] += 1
            self._send(200 if asks[0] > 5 else 503, {"status": "ok" if asks[0] > 5 else "loading model"})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._send(200, {"choices": [{"text": "x"}], "usage": {"completion_tokens": min(body["max_tokens"], 30)}})
    ThreadingHTTPServer((args[args.index("--host") + 1], int(args[args.index("--port") + 1])), H).serve_forever()
''')


def _fake(tmp_path):
    script = tmp_path / "fake-llama-server"
    script.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    script.chmod(0o755)
    return str(script)


def test_llama_server_launcher_waits_for_health_and_stops_it(tmp_path):
    import asyncio
    with ls.llama_server(_fake(tmp_path), "/m/q.gguf", 2, timeout=30) as url:
        assert asyncio.run(ls.burst(url, [[1, 2, 3]] * 3, 7)) > 0
    import httpx
    with pytest.raises(httpx.HTTPError):            # terminated on leaving the block
        httpx.get(url + "/health", timeout=2)
    import json
    argv = json.loads((tmp_path / "fake-llama-server.argv").read_text())
    assert argv[:8] == ["-m", "/m/q.gguf", "-np", "8", "-c", "8192", "-t", "2"]


def test_llama_server_that_dies_is_reported(tmp_path):
    script = tmp_path / "broken"
    script.write_text(f"#!{sys.executable}\nimport sys; sys.exit(3)\n")
    script.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited with code 3 before it was healthy"):
        with ls.llama_server(str(script), "/m/q.gguf", 2, timeout=30):
            pass


def _sim_worker(model: str, **over) -> WorkerConfig:
    base = WorkerConfig(model=model, calibrate=False, max_active=8, **over)
    return parse_devices(["sim:fast:prefill=20000,decode=2000"], base)[0]


def test_two_servers_side_by_side_through_one_client(tiny_model_path):
    from engine.models.tokenizer import Tokenizer
    model = str(tiny_model_path("qwen2"))
    tok = Tokenizer.from_gguf(model)
    make = lambda tag: tok.encode(tag + " some words to fill the prompt", add_special=False)[:12]   # noqa: E731
    with ls.tokentop_server(_sim_worker(model)) as a, ls.tokentop_server(_sim_worker(model)) as b:
        out = ls.compare({"tokentop": a, "other": b}, make, [1, 8], runs=2, out_tokens=6)
    assert [r["n"] for r in out["table"]] == [1, 8]
    for row in out["table"]:
        assert len(row["tokentop_runs"]) == len(row["other_runs"]) == 2
        assert row["tokentop_tok_s"] > 0 and row["other_tok_s"] > 0
        assert row["tokentop_over_other"] == round(row["tokentop_tok_s"] / row["other_tok_s"], 3)


def test_a_request_cut_short_fails_the_burst(tmp_path):
    """Aggregate tok/s counts asked tokens: a server that stops early must not look fast."""
    import asyncio
    with ls.llama_server(_fake(tmp_path), "/m/q.gguf", 2, timeout=30) as url:
        with pytest.raises(RuntimeError, match="produced 30 tokens, not 40"):
            asyncio.run(ls.burst(url, [[5, 6, 7, 8]] * 2, 40))


@pytest.mark.realmodel
@pytest.mark.slow
def test_real_llama_server_side_by_side(real_model_path):
    binary = os.environ.get("LLAMA_SERVER")
    if not binary or not os.path.exists(binary):
        pytest.skip("no llama-server binary (set LLAMA_SERVER; shared/models.md says how to build it)")
    from types import SimpleNamespace
    worker = WorkerConfig(model=str(real_model_path), calibrate=False, max_active=8, threads=2)
    out = ls.bench_llama_server(SimpleNamespace(llama_server=binary), worker, str(real_model_path),
                                out_tokens=8, runs=1, ns=[1, 8])
    assert [r["n"] for r in out["table"]] == [1, 8]
    assert all(r["llama_server_tok_s"] > 0 and r["tokentop_tok_s"] > 0 for r in out["table"])
