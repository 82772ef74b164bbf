"""Remote workers (`--device remote:URL[,...]`, engine/remote/spec.py): an OpenAI-compatible
server behind the router.

The server can be another `tokentop serve`, a vLLM, an SGLang or a llama.cpp server, over
http or https, with an API key from the environment. The worker is a thread of asyncio I/O in
the facade's process that speaks the same messages as a local worker: Submit/Abort in,
StepEvents/WorkerStats out. Its parts:

* engine/remote/probe.py: connecting, and what the server is (model, context, /tokenize);
* engine/remote/stream.py: each routed request as one streaming POST, tokens back;
* engine/remote/scrape.py: the server's own load from its /metrics;
* engine/remote/tokens.py: prompt lengths from a remote of another model (RemoteTokenCounter).

States. Ready once a probe passes. Down when the connection fails or the server answers 5xx or
refuses the key: /health is probed every second until it answers 200, then it is admitted
again. Degraded when a stream stalls (no data for read_timeout): no new requests until a probe
also sees a token generated in time. Down or degraded, requests that streamed nothing are
rerouted by the facade; the others fail with the reason.

Load. What the server runs or queues beyond our requests (other clients') is reported as
external requests, which the facade adds to the router's account of this worker.
"""
from __future__ import annotations

import asyncio
import threading
import time

import httpx

from engine import messages as msg
from engine.config import WorkerConfig
from engine.errors import describe_error
from engine.remote.probe import Connection
from engine.remote.scrape import SCRAPE_INTERVAL, SCRAPE_NAMES, scrape
from engine.remote.spec import Secret, client_timeout, remote_url
from engine.remote.stream import Forwarder

STATS_INTERVAL = 0.2
PROBE_INTERVAL = 1.0
RATE_WINDOW = 2.0


class RemoteWorker:
    def __init__(self, index: int, cfg: WorkerConfig, model_path: str, commands, events):
        from engine.models.tokenizer import Tokenizer

        self.index, self.cfg, self.commands, self.emit = index, cfg, commands, events.put
        self.url = remote_url(cfg)
        self.secret = Secret(cfg.remote_options)
        self.tokenizer = Tokenizer.from_gguf(model_path)
        self.state = "starting"        # ready | down | degraded (what the facade was last told)
        self.said = ""                 # the last reason given for not being ready
        self.tasks: dict[str, asyncio.Task] = {}
        self.scraped: dict[str, float | None] = {key: None for key in SCRAPE_NAMES}
        self.stopping = False

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    # --- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue = asyncio.Queue()
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        client = httpx.AsyncClient(base_url=self.url, limits=limits, timeout=client_timeout(self.cfg.remote_options),
                                   **self.secret.client_kwargs())
        self.conn = Connection(self.cfg, self.url, client, self.secret)
        self.fwd = Forwarder(self.index, self.conn, self.tokenizer, self.emit, self._mark_down, self._mark_degraded)
        threading.Thread(target=self._pump, name=f"tokentop-remote-{self.index}-cmds", daemon=True).start()
        self.emit(msg.WorkerLoading(self.index, f"connecting to {self.url}"))
        background = [asyncio.ensure_future(f()) for f in (self._probe_loop, self._stats_loop, self._scrape_loop)]
        try:
            while not self.stopping:
                self._handle(await self.inbox.get())
        finally:
            for t in background:
                t.cancel()
            for task in list(self.tasks.values()):
                task.cancel()
            await asyncio.gather(*self.tasks.values(), *background, return_exceptions=True)
            await client.aclose()

    def _pump(self) -> None:
        """Commands arrive on a thread queue; hand them to the event loop."""
        while True:
            cmd = self.commands.get()
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, cmd)
            if isinstance(cmd, msg.Stop):
                return

    def _handle(self, cmd) -> None:
        if isinstance(cmd, msg.Submit):
            if not self.ready:
                self.emit(msg.Reroute(self.index, cmd.request_id, self.said or f"{self.url} is not ready"))
                return
            self.fwd.open(cmd)
            task = asyncio.ensure_future(self.fwd.forward(cmd))
            self.tasks[cmd.request_id] = task
            task.add_done_callback(lambda _t, cmd=cmd: self._forward_done(cmd))
        elif isinstance(cmd, msg.Abort):
            task = self.tasks.get(cmd.request_id)
            if task is not None:
                task.cancel()         # closes the stream: the server aborts it too
        elif isinstance(cmd, msg.Stop):
            self.stopping = True
        elif isinstance(cmd, msg.SendTrace):
            self.emit(msg.TraceEvents(self.index, []))

    # --- health ---------------------------------------------------------------------------
    async def _probe_loop(self) -> None:
        while True:
            if not self.ready:
                problem = await self.conn.probe(generate=self.state == "degraded")
                if problem is None:
                    self.state, self.said = "ready", ""
                    self.emit(msg.WorkerReady(self.index, self.conn.info(self.fwd.prefill_tps, self.fwd.decode_tps)))
                elif problem != self.said:
                    self.said = problem
                    if self.state == "degraded":
                        self.emit(msg.WorkerDegraded(self.index, problem))
                    else:
                        self.state = "down"
                        self.emit(msg.WorkerDown(self.index, problem))
            await asyncio.sleep(PROBE_INTERVAL)

    def _mark_down(self, reason: str) -> None:
        if self.state != "down":
            self.state, self.said = "down", reason
            self.emit(msg.WorkerDown(self.index, reason))

    def _forward_done(self, cmd: msg.Submit) -> None:
        self.tasks.pop(cmd.request_id, None)
        self.fwd.never_started(cmd)

    def _mark_degraded(self, reason: str) -> None:
        if self.state == "ready":
            self.state, self.said = "degraded", reason
            self.emit(msg.WorkerDegraded(self.index, reason))

    # --- load -------------------------------------------------------------------------------
    async def _stats_loop(self) -> None:
        fwd = self.fwd
        while True:
            await asyncio.sleep(STATS_INTERVAL)
            now = time.monotonic()
            fwd.history = [h for h in fwd.history if now - h[0] <= RATE_WINDOW]
            span = max(now - fwd.history[0][0], 0.25) if fwd.history else 1.0
            decode = sum(h[1] for h in fwd.history) / span if fwd.history else 0.0
            mine_running = sum(1 for n in fwd.streamed.values() if n)
            scraped = self.scraped["running"] is not None or self.scraped["waiting"] is not None
            running = self.scraped["running"] if self.scraped["running"] is not None else mine_running
            waiting = self.scraped["waiting"] if self.scraped["waiting"] is not None \
                else len(fwd.streamed) - mine_running
            # the server's own count beyond ours: other clients' requests, work the router must see
            external = max(0, int(running) + int(waiting) - len(fwd.streamed)) if scraped else 0
            # a request that streams has had its prompt computed: the router stops counting it
            seqs = tuple(msg.SeqView(rid, "decode" if n else "waiting", fwd.prompt_len.get(rid, 0), 0,
                                     fwd.prompt_len.get(rid, 0) if n else 0, n, 0)
                         for rid, n in fwd.streamed.items())
            self.emit(msg.WorkerStats(
                worker=self.index, running=int(running), waiting=int(waiting), pages_total=0, pages_used=0,
                page_states=b"", prefill_tps=0.0, decode_tps=decode, steps=0, tokens_in_last_step=0,
                policy="remote", seqs=seqs, kv_usage=self.scraped["kv"], external_requests=external))

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.sleep(SCRAPE_INTERVAL)
            if self.ready:
                self.scraped = await scrape(self.conn.client)


def remote_worker_main(index: int, cfg: WorkerConfig, model_path: str, commands, events) -> None:
    """Thread entry, like worker_main: never raises; death is an event."""
    secret = Secret(cfg.remote_options)
    try:
        RemoteWorker(index, cfg, model_path, commands, events).run()
    except BaseException as exc:  # noqa: BLE001
        events.put(msg.WorkerDead(index, secret.redact(describe_error(exc))))
