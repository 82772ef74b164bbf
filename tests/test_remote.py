"""Remote workers: two real `tokentop serve` processes behind a third tokentop's router.

The two servers run simulated workers (labelled; fast and light on 2 cores) on the bundled
model's tokenizer; the front has a local simulated worker too. Loopback only, bounded in time.
"""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from engine.config import WorkerConfig
from engine.facade.devices import parse_devices
from engine.errors import ConfigError
from tests.serve_util import ServeProcess, in_process_server

MODEL = "qwen2.5-coder-0.5b"
REMOTE = ["--device", "sim:r:prefill=5000,decode=30", "--worker-mode", "thread", "--max-active", "8",
          "--model", MODEL]


def test_remote_spec_parsing():
    base = WorkerConfig()
    a, b = parse_devices(["remote:http://127.0.0.1:8001/,name=a", "remote:https://h:9"], base)
    assert (a.device, a.name, a.remote) == ("remote:http://127.0.0.1:8001", "a", True)
    assert b.name == "remote1" and not b.calibrate
    with pytest.raises(ConfigError, match="remote:http://HOST:PORT"):
        parse_devices(["remote:127.0.0.1:8001"], base)
    with pytest.raises(ConfigError, match="unknown field 'weight=2'"):
        parse_devices(["remote:http://h:1,weight=2"], base)


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_two_tokentop_servers_as_remote_workers_kill_and_restart(real_model_path):
    a, b = ServeProcess(REMOTE), ServeProcess(REMOTE)
    port_a = int(a.url.rsplit(":", 1)[1])
    devices = ["sim:local:prefill=5000,decode=100", f"remote:{a.url},name=a", f"remote:{b.url},name=b"]
    try:
        with in_process_server(real_model_path, devices, max_active=8, max_queue=1000) as (engine, http):
            snap = engine.snapshot()
            assert [w.state for w in snap.workers] == ["ready"] * 3
            assert snap.workers[1].remote_url == a.url and "same model" in snap.workers[1].note

            results: dict[int, object] = {}

            async def one(c, i):
                try:
                    stream = await c.completions.create(model=MODEL, prompt=f"request {i} " * 6, max_tokens=30,
                                                        stream=True, stream_options={"include_usage": True})
                    chunks = [ch async for ch in stream]
                    results[i] = chunks[-1].usage.completion_tokens
                except openai.APIError as exc:
                    results[i] = exc

            async def burst(n, kill_a=False):
                async with openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0,
                                              timeout=60) as c:
                    tasks = [asyncio.ensure_future(one(c, i)) for i in range(n)]
                    if kill_a:
                        while not any(r.worker == 1 and r.output_tokens > 0 for r in engine.snapshot().requests):
                            await asyncio.sleep(0.05)
                        a.kill()                     # mid-burst: its streams drop
                    await asyncio.wait_for(asyncio.gather(*tasks), 90)

            asyncio.run(burst(24, kill_a=True))
            snap = engine.snapshot()
            routed = {w: [r for r in snap.requests if r.worker == w] for w in range(3)}
            assert all(routed[w] for w in range(3)), "the cost policy spread the burst over all workers"
            failed = {i for i, r in results.items() if isinstance(r, Exception)}
            assert failed, "some requests were streaming on the killed server"
            assert all(results[i] == 30 for i in results if i not in failed)
            errors = [r for r in snap.requests if r.state == "error"]
            assert len(errors) == len(failed) and all(r.worker == 1 for r in errors)
            assert all("failed mid-stream" in r.error for r in errors)
            assert snap.workers[1].state == "down" and snap.workers[2].state == "ready"
            from tests.test_serve import metrics, total
            m = metrics(http.url)       # the front's /metrics says so too, per worker
            assert total(m, "tokentop:worker_state", worker="a", state="down") == 1
            assert total(m, "tokentop:worker_info", worker="b", remote="true") == 1
            assert total(m, "tokentop:request_failures_total", worker="a") == len(failed)
            # while it is down, nothing new goes to it
            before = {r.id for r in snap.requests}
            results.clear()
            asyncio.run(burst(6))
            assert all(v == 30 for v in results.values())
            new = [r for r in engine.snapshot().requests if r.id not in before]
            assert new and all(r.worker != 1 for r in new)
            # restarted on the same port, it is probed and re-admitted
            a = ServeProcess(REMOTE + ["--port", str(port_a)])
            wait_for(lambda: engine.snapshot().workers[1].state == "ready", 20, "the restarted remote")
            res = engine.submit("back again", params=engine_params(), worker=1).result(30)
            assert res.finish_reason == "length" and len(res.token_ids) == 5 and res.worker == 1
            assert engine.snapshot().workers[1].profile_decode_tps > 0     # measured from its streams
    finally:
        a.stop()
        b.stop()


def engine_params():
    from engine.config import SamplingParams
    return SamplingParams(max_tokens=5)


class FailingServer:
    """An OpenAI-shaped server on loopback that is healthy but answers every completion with
    `status` (503: busy, reroute; 400: the request itself is bad, report it)."""

    def __init__(self, status: int):
        import threading

        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def health(_):
            return JSONResponse({"status": "ok"})

        async def models(_):
            return JSONResponse({"object": "list", "data": [{"id": "other-model", "object": "model"}]})

        async def complete(request):
            self.bodies.append(await request.json())
            return JSONResponse({"error": {"message": f"refused with {status}", "type": "x", "param": None,
                                           "code": None}}, status_code=status)

        from engine.serve.server import bind
        self.bodies: list[dict] = []
        app = Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                                Route("/v1/completions", complete, methods=["POST"]),
                                Route("/v1/chat/completions", complete, methods=["POST"])])
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.should_exit = True
        self.thread.join(5)


@pytest.mark.parametrize("status", [503, 400])
def test_a_refusing_remote_reroutes_busy_and_reports_bad(real_model_path, status):
    from engine.config import SamplingParams

    remote = FailingServer(status)
    try:
        devices = [f"remote:{remote.url},name=far", "sim:near:prefill=5000,decode=200"]
        with in_process_server(real_model_path, devices) as (engine, http):
            w = engine.snapshot().workers[0]
            assert w.state == "ready" and "estimate" in w.note        # another model: lengths estimated
            h = engine.submit(messages=[{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=3),
                              worker=0)
            res = h.result(20)
            assert remote.bodies and remote.bodies[0]["messages"] == [{"role": "user", "content": "hi"}]
            assert remote.bodies[0]["model"] == "other-model"
            if status == 503:       # busy: rerouted to the local worker, and it succeeds there
                assert res.worker == 1 and res.finish_reason == "length" and len(res.token_ids) == 3
                assert any("rerouted from worker 0" in line.text for line in engine.snapshot().log)
            else:                   # the server says the request is bad: the client hears why
                assert res.finish_reason == "error" and "refused with 400" in res.error and res.worker == 0
            assert engine.snapshot().workers[0].state == "ready"     # neither marks it down
    finally:
        remote.stop()


def test_a_request_with_only_an_unreachable_remote_says_why(tiny_model_path):
    """With no worker ready, the refusal names each worker and what it last said ("still loading,
    or all workers died" alone would leave a wrong URL to guess)."""
    import socket

    from engine.config import EngineConfig
    from engine.facade.engine import Engine
    from engine.errors import InvalidRequest

    with socket.socket() as s:          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = WorkerConfig(model=str(tiny_model_path("qwen2")))
    engine = Engine(EngineConfig(workers=tuple(parse_devices([f"remote:http://127.0.0.1:{port}"], base)))).start()
    try:
        with pytest.raises(InvalidRequest, match=rf"worker 0 \(remote:http://127.0.0.1:{port}\) down: cannot reach"):
            engine.submit("hello")
    finally:
        engine.shutdown()


def test_an_abort_right_behind_its_submit_still_finishes_the_request(tiny_model_path):
    """Submit and Abort handled in one go: the forward's task is cancelled before its first step,
    so its body (which reports an abort when cancelled) never runs. The request must still end,
    as aborted; unreported, it stayed queued forever (its handle never returned, its table entry
    never went). `bench soak` found it: requests aborted at once, routed to the remote."""
    import queue

    from engine import messages as msg
    from engine.config import SamplingParams
    from engine.remote.worker import RemoteWorker

    cfg = parse_devices(["remote:http://127.0.0.1:1,name=far"], WorkerConfig(model=str(tiny_model_path("qwen2"))))[0]
    events: queue.Queue = queue.Queue()
    worker = RemoteWorker(0, cfg, cfg.model, queue.Queue(), events)

    async def submit_then_abort():
        import httpx

        from engine.remote.probe import Connection
        from engine.remote.stream import Forwarder
        client = httpx.AsyncClient(base_url=worker.url)   # never reached: the task never runs
        worker.conn = Connection(worker.cfg, worker.url, client, worker.secret)
        worker.fwd = Forwarder(worker.index, worker.conn, worker.tokenizer, worker.emit,
                               worker._mark_down, worker._mark_degraded)
        worker.state = "ready"
        worker._handle(msg.Submit("r1", (1, 2, 3), SamplingParams(max_tokens=4), time.monotonic()))
        worker._handle(msg.Abort("r1"))
        for _ in range(5):
            await asyncio.sleep(0)
        await client.aclose()

    asyncio.run(submit_then_abort())
    finished = [f for e in list(events.queue) if isinstance(e, msg.StepEvents) for f in e.finished]
    assert [(f.request_id, f.reason) for f in finished] == [("r1", "abort")]
    assert not worker.tasks and not worker.fwd.streamed and not worker.fwd.prompt_len   # nothing left behind
