"""Remote workers (`--device remote:URL[,name=NAME]`): an OpenAI-compatible server behind the router.

The server can be another `tokentop serve`, a vLLM, an SGLang or a llama.cpp server. The
worker is a thread of asyncio I/O in the facade's process that speaks the same messages as
a local worker: Submit/Abort in, StepEvents/WorkerStats out. Each routed request becomes one
streaming POST (httpx); aborting it closes the stream, which the server sees as a disconnect.

* Prompts. When the server serves the model the facade tokenized with (same model id), the
  prompt goes as token ids to /v1/completions: exact, and chat templates applied once. Else
  chat messages go to /v1/chat/completions and plain prompts as text.
* Prompt lengths for the router. Same model: the local tokenizer's count. Another model: the
  server's own POST /tokenize, when the probe found one (vLLM's and tokentop's shape
  {"model", "prompt"|"messages"} -> {"count"}, or llama.cpp's {"content"} -> {"tokens"}, with
  its /apply-template for chat), asked by the facade at submit with a short timeout
  (RemoteTokenCounter); else, or when that call fails, the local count labelled an estimate.
* Logprobs. Asked of the server when the client asked (logprobs / top_logprobs; llama.cpp's
  n_probs too) and passed back by token text, in either of OpenAI's two shapes.
* Rates. Prefill tok/s = prompt tokens / TTFT and decode tok/s = tokens / time after the first,
  measured on every stream and smoothed; they replace the nominal rates in the cost router.
* Load. The server's own running / waiting requests and KV usage are scraped from its
  /metrics (vLLM's or llama.cpp's names) every second and shown; no KV page grid exists here.
  What it runs or queues beyond our requests (other clients') is reported as external
  requests, which the facade adds to the router's account of this worker.
* Failure. A refused or dropped connection marks the worker down: requests that streamed
  nothing yet are rerouted by the facade, the others fail with the reason; while down it gets
  no new requests and /health is probed every second until it answers 200, then re-admitted.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx

from engine import messages as msg
from engine.config import WorkerConfig
from engine.errors import ConfigError, describe_error

STATS_INTERVAL = 0.2
SCRAPE_INTERVAL = 1.0
PROBE_INTERVAL = 1.0
SMOOTHING = 0.3           # weight of the newest measurement in the smoothed rates
RATE_WINDOW = 2.0
TOKENIZE_TIMEOUT = 0.5    # s: a prompt-length call to a remote's /tokenize, at submit
TOKENIZE_BACKOFF = 10.0   # s: after a failed /tokenize, estimates only for this long
TOKENIZE_CACHE = 512      # prompt lengths kept per remote (a burst repeats its prompts)
PROBE_TEXT = "Hello, world"

# how a remote counts tokens (WorkerInfo.tokenize)
TOKENIZE_SAME = "same-model"      # the local tokenizer is the remote's
TOKENIZE_OPENAI = "tokenize"      # vLLM / tokentop: POST /tokenize {"model", "prompt"|"messages"} -> count
TOKENIZE_LLAMACPP = "tokenize-llamacpp"   # llama.cpp: POST /tokenize {"content"} -> tokens
TOKENIZE_NONE = ""                # none: the local count stands in, labelled an estimate

# running, waiting, KV usage (0..1) as vLLM and llama.cpp's server name them
SCRAPE_NAMES = {
    "running": ("vllm:num_requests_running", "llamacpp:requests_processing", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "llamacpp:requests_deferred", "sglang:num_queue_reqs"),
    "kv": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio",
           "sglang:token_usage"),
}


def parse_remote(spec: str, base: WorkerConfig, count: int) -> WorkerConfig:
    """remote:URL[,name=NAME] -> a WorkerConfig whose device is remote:URL."""
    body = spec[len("remote:"):]
    url, *fields = body.split(",")
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"`device={spec}`: write remote:http://HOST:PORT[,name=NAME], "
                          "e.g. `device=remote:http://127.0.0.1:8001`")
    name = f"remote{count or ''}"
    for item in fields:
        key, _, value = item.partition("=")
        if key != "name" or not value:
            raise ConfigError(f"`device={spec}`: unknown field {item!r}; the only field is name=NAME")
        name = value
    return replace(base, device=f"remote:{url}", name=name, calibrate=False)


class RemoteWorker:
    def __init__(self, index: int, cfg: WorkerConfig, model_path: str, commands, events):
        from engine.models.tokenizer import Tokenizer

        self.index, self.cfg, self.commands, self.emit = index, cfg, commands, events.put
        self.url = cfg.device[len("remote:"):]
        self.tokenizer = Tokenizer.from_gguf(model_path)
        self.local_model = cfg.model
        self.remote_model: str | None = None
        self.same_model = False
        self.tokenize = TOKENIZE_NONE
        self.owned_by = ""
        self.max_context = cfg.max_context
        self.ready = False
        self.tasks: dict[str, asyncio.Task] = {}
        self.streamed: dict[str, int] = {}      # request id -> tokens streamed so far
        self.prompt_len: dict[str, int] = {}
        self.prefill_tps = 0.0
        self.decode_tps = 0.0
        self.history: list[tuple[float, int]] = []
        self.scraped = {"running": None, "waiting": None, "kv": None}
        self.stopping = False

    # --- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue = asyncio.Queue()
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=self.url, limits=limits,
                                        timeout=httpx.Timeout(10.0, read=None))
        threading.Thread(target=self._pump, name=f"tokentop-remote-{self.index}-cmds", daemon=True).start()
        self.emit(msg.WorkerLoading(self.index, f"connecting to {self.url}"))
        background = [asyncio.ensure_future(f()) for f in (self._probe_loop, self._stats_loop, self._scrape_loop)]
        try:
            while not self.stopping:
                self._handle(await self.inbox.get())
        finally:
            for t in background:
                t.cancel()
            for rid, task in list(self.tasks.items()):
                task.cancel()
            await asyncio.gather(*self.tasks.values(), *background, return_exceptions=True)
            await self.client.aclose()

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
                self.emit(msg.Reroute(self.index, cmd.request_id, f"{self.url} is down"))
                return
            self.streamed[cmd.request_id] = 0
            self.prompt_len[cmd.request_id] = cmd.prompt_tokens or len(cmd.prompt_ids)
            task = self.tasks[cmd.request_id] = asyncio.ensure_future(self._forward(cmd))
            task.add_done_callback(lambda t, cmd=cmd: self._never_started(cmd, t))
        elif isinstance(cmd, msg.Abort):
            task = self.tasks.get(cmd.request_id)
            if task is not None:
                task.cancel()         # closes the stream: the server aborts it too
        elif isinstance(cmd, msg.Stop):
            self.stopping = True
        elif isinstance(cmd, msg.DrainTrace):
            self.emit(msg.TraceEvents(self.index, []))

    # --- health ---------------------------------------------------------------------------
    async def _probe_loop(self) -> None:
        while True:
            if not self.ready:
                problem = await self._probe()
                if problem is None:
                    self.ready = True
                    self.emit(msg.WorkerReady(self.index, self._info()))
                elif not hasattr(self, "_said_down") or self._said_down != problem:
                    self._said_down = problem
                    self.emit(msg.WorkerDown(self.index, problem))
            await asyncio.sleep(PROBE_INTERVAL)

    async def _probe(self) -> str | None:
        try:
            health = await self.client.get("/health", timeout=3)
            if health.status_code != 200:
                return f"{self.url}/health answers {health.status_code}"
            models = (await self.client.get("/v1/models", timeout=3)).json().get("data") or []
        except (httpx.HTTPError, ValueError) as exc:
            return f"cannot reach {self.url}: {_reason(exc)}"
        ids = [m.get("id") for m in models]
        if not ids:
            return f"{self.url}/v1/models lists no model"
        mine = [n for n in (self.local_model, Path(self.local_model).stem) if n in ids]
        self.same_model = bool(mine)
        self.remote_model = mine[0] if mine else ids[0]
        self.owned_by = next((str(m.get("owned_by") or "") for m in models if m.get("id") == self.remote_model), "")
        self.tokenize = TOKENIZE_SAME if self.same_model else await self._probe_tokenize()
        # vLLM and tokentop say max_model_len; llama.cpp's server says meta.n_ctx (per slot)
        ctx = next((m.get("max_model_len") or (m.get("meta") or {}).get("n_ctx")
                    for m in models if m.get("id") == self.remote_model), None)
        self.max_context = int(ctx) if isinstance(ctx, int) and ctx > 0 else self.cfg.max_context
        self._said_down = None
        return None

    async def _probe_tokenize(self) -> str:
        """Which /tokenize the server has, asked once per admission: vLLM's (and tokentop's)
        shape first; llama.cpp's answers that one with no tokens (it reads only "content")."""
        for shape, body in ((TOKENIZE_OPENAI, {"model": self.remote_model, "prompt": PROBE_TEXT}),
                            (TOKENIZE_LLAMACPP, {"content": PROBE_TEXT})):
            try:
                r = await self.client.post("/tokenize", json=body, timeout=3)
                if r.status_code == 404:
                    return TOKENIZE_NONE
                if r.status_code == 200 and _token_count(r.json()):
                    return shape
            except (httpx.HTTPError, ValueError, AttributeError):
                return TOKENIZE_NONE
        return TOKENIZE_NONE

    def _info(self) -> msg.WorkerInfo:
        note = {TOKENIZE_SAME: "prompt lengths: local tokenizer (same model)",
                TOKENIZE_OPENAI: f"prompt lengths: the remote's /tokenize (it serves {self.remote_model})",
                TOKENIZE_LLAMACPP: f"prompt lengths: the remote's /tokenize (llama.cpp; it serves "
                                   f"{self.remote_model})"}.get(
            self.tokenize, f"prompt lengths: estimate (local {self.local_model} tokenizer; remote serves "
                           f"{self.remote_model} and has no /tokenize)")
        return msg.WorkerInfo(
            name=self.cfg.name, model=self.remote_model, dtype="remote", pages=0,
            page_size=0, max_context=self.max_context, device=self.cfg.device, simulated=False,
            remote=True, url=self.url, max_active=self.cfg.max_active, policy="remote", note=note,
            tokenize=self.tokenize,
            profile_prefill_tps=self.prefill_tps, profile_decode_tps=self.decode_tps,
            summary=f"forwarding to {self.url} ({self.remote_model}; {note})")

    def _mark_down(self, reason: str) -> None:
        if self.ready:
            self.ready = False
            self._said_down = reason
            self.emit(msg.WorkerDown(self.index, reason))

    # --- one request ------------------------------------------------------------------------
    async def _forward(self, cmd: msg.Submit) -> None:
        rid, p = cmd.request_id, cmd.params
        sent = time.monotonic()
        first = None
        n_out, text_parts = 0, []
        usage = None
        finish = None
        try:
            path, body = self._body(cmd)
            async with self.client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    detail = await _error_text(r)
                    if r.status_code in (429, 503) or r.status_code >= 500:
                        if r.status_code >= 500 and r.status_code != 503:
                            self._mark_down(f"{self.url} answered {r.status_code}: {detail}")
                        self.emit(msg.Reroute(self.index, rid, f"{self.url} answered {r.status_code}: {detail}"))
                    else:
                        self._finish(rid, "error", f"{self.url} refused the request ({r.status_code}): {detail}",
                                     cmd, sent, first, n_out, None)
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        err = chunk["error"]
                        raise _RemoteFailed(err.get("message") if isinstance(err, dict) else str(err))
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        text = choice.get("text")
                        if text is None:
                            text = (choice.get("delta") or {}).get("content") or ""
                        ids = choice.get("token_ids") or []
                        deltas = self._deltas(rid, text, ids, _logprob_entries(choice.get("logprobs"), p.logprobs))
                        if deltas:
                            if first is None:
                                first = time.monotonic()
                            n_out += len(deltas)
                            self.streamed[rid] = n_out
                            self.history.append((time.monotonic(), len(deltas)))
                            self.emit(msg.StepEvents(self.index, tuple(deltas), ()))
                        finish = choice.get("finish_reason") or finish
            if usage and usage.get("completion_tokens") is not None:
                n_out = usage["completion_tokens"]
            prompt_tokens = (usage or {}).get("prompt_tokens") or cmd.prompt_tokens or len(cmd.prompt_ids)
            self._measure(prompt_tokens, sent, first, n_out)
            self._finish(rid, finish if finish in ("stop", "length") else "stop", None, cmd, sent, first, n_out,
                         prompt_tokens)
        except asyncio.CancelledError:
            self._finish(rid, "abort", None, cmd, sent, first, n_out, None)
        except (httpx.HTTPError, OSError) as exc:
            reason = f"lost {self.url}: {_reason(exc)}"
            self._mark_down(reason)
            if self.streamed.get(rid):
                self._finish(rid, "error", f"remote worker {self.cfg.name} failed mid-stream ({reason})",
                             cmd, sent, first, n_out, None)
            else:
                self.emit(msg.Reroute(self.index, rid, reason))
        except (_RemoteFailed, ValueError, KeyError, TypeError) as exc:
            self._finish(rid, "error", f"remote worker {self.cfg.name}: {exc}", cmd, sent, first, n_out, None)
        finally:
            self.tasks.pop(rid, None)
            self.streamed.pop(rid, None)
            self.prompt_len.pop(rid, None)

    def _never_started(self, cmd: msg.Submit, task: asyncio.Task) -> None:
        """A forward cancelled before its first step (an Abort handled right behind its Submit)
        never ran its body, which reports the abort and forgets the request: do both here."""
        rid = cmd.request_id
        if self.tasks.get(rid) is task:     # the body's `finally` would have removed it
            del self.tasks[rid]
            self.streamed.pop(rid, None)
            self.prompt_len.pop(rid, None)
            self._finish(rid, "abort", None, cmd, time.monotonic(), None, 0, None)

    def _body(self, cmd: msg.Submit) -> tuple[str, dict]:
        p = cmd.params
        body = {"model": self.remote_model, "max_tokens": p.max_tokens, "temperature": p.temperature,
                "top_p": p.top_p, "stream": True, "stream_options": {"include_usage": True}}
        if p.top_k:
            body["top_k"] = p.top_k
        if p.min_p:
            body["min_p"] = p.min_p
        if p.repetition_penalty != 1.0:
            body["repetition_penalty"] = p.repetition_penalty
        if p.presence_penalty:
            body["presence_penalty"] = p.presence_penalty
        if p.frequency_penalty:
            body["frequency_penalty"] = p.frequency_penalty
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if p.ignore_eos:
            body["ignore_eos"] = True
        if p.cache_salt is not None:
            body["cache_salt"] = p.cache_salt        # vLLM's and tokentop's name
        if p.stop_token_ids and self.same_model:      # ids of our vocabulary: only where it is theirs
            body["stop_token_ids"] = list(p.stop_token_ids)
        chat = not self.same_model and cmd.messages is not None
        if p.return_logprobs:
            # llama.cpp sends logprobs only for at least one alternative (its n_probs, which its
            # chat endpoint takes from top_logprobs): ask for one, pass back the number asked
            llama = self.tokenize == TOKENIZE_LLAMACPP or self.owned_by == "llamacpp"
            top = max(1, p.logprobs) if llama else p.logprobs
            if chat:
                body["logprobs"], body["top_logprobs"] = True, top
            else:
                body["logprobs"] = p.logprobs
                if llama:
                    body["n_probs"] = top    # its completions endpoint reads only this name
        if self.same_model:
            # the exact tokens, template applied once, here; ask for the generated ids back
            return "/v1/completions", {**body, "prompt": list(cmd.prompt_ids), "return_token_ids": True}
        if chat:
            return "/v1/chat/completions", {**body, "messages": list(cmd.messages)}
        return "/v1/completions", {**body, "prompt": self.tokenizer.decode(list(cmd.prompt_ids))}

    def _deltas(self, rid: str, text: str, ids: list[int], lps: list) -> list[msg.TokenDelta]:
        """One delta per token of a chunk (the chunk's text on the first): its id where the server
        returned ids (same model), else -1; its logprob by token text where it sent logprobs."""
        n = max(len(ids), len(lps), 1 if text else 0)
        out = []
        for i in range(n):
            lp = lps[i] if i < len(lps) else None
            out.append(msg.TokenDelta(rid, ids[i] if i < len(ids) else -1, text if i == 0 else "",
                                      lp[1] if lp else None, (), token_str=lp[0] if lp else None,
                                      top_strs=lp[2] if lp else ()))
        return out

    def _finish(self, rid, reason, error, cmd, sent, first, n_out, prompt_tokens) -> None:
        now = time.monotonic()
        m = msg.RequestMetrics(
            prompt_tokens=prompt_tokens or cmd.prompt_tokens or len(cmd.prompt_ids), cached_tokens=0, output_tokens=n_out,
            queue_time=sent - cmd.arrival, ttft=None if first is None else first - cmd.arrival,
            itl_mean=(now - first) / (n_out - 1) if first is not None and n_out > 1 else None,
            itl_max=None, e2e=now - cmd.arrival)
        self.emit(msg.StepEvents(self.index, (), (msg.Finished(rid, reason, error, m),)))

    # --- rates and load ---------------------------------------------------------------------
    def _measure(self, prompt_tokens: int, sent: float, first: float | None, n_out: int) -> None:
        if first is None:
            return
        now = time.monotonic()
        pre = prompt_tokens / max(first - sent, 1e-3)
        self.prefill_tps = pre if not self.prefill_tps else (1 - SMOOTHING) * self.prefill_tps + SMOOTHING * pre
        if n_out > 1 and now > first:
            dec = (n_out - 1) / (now - first)
            self.decode_tps = dec if not self.decode_tps else (1 - SMOOTHING) * self.decode_tps + SMOOTHING * dec
        self.emit(msg.ProfileUpdate(self.index, self.prefill_tps, self.decode_tps))

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL)
            now = time.monotonic()
            self.history = [h for h in self.history if now - h[0] <= RATE_WINDOW]
            span = max(now - self.history[0][0], 0.25) if self.history else 1.0
            decode = sum(h[1] for h in self.history) / span if self.history else 0.0
            mine_running = sum(1 for n in self.streamed.values() if n)
            running = self.scraped["running"] if self.scraped["running"] is not None else mine_running
            waiting = self.scraped["waiting"] if self.scraped["waiting"] is not None \
                else len(self.streamed) - mine_running
            # the server's own count beyond ours: other clients' requests, work the router must see
            external = max(0, int(running) + int(waiting) - len(self.streamed)) \
                if self.scraped["running"] is not None or self.scraped["waiting"] is not None else 0
            # a request that streams has had its prompt computed: the router stops counting it
            seqs = tuple(msg.SeqView(rid, "decode" if n else "waiting", self.prompt_len.get(rid, 0), 0,
                                     self.prompt_len.get(rid, 0) if n else 0, n, 0)
                         for rid, n in self.streamed.items())
            self.emit(msg.WorkerStats(
                worker=self.index, running=int(running), waiting=int(waiting), pages_total=0, pages_used=0,
                page_states=b"", prefill_tps=0.0, decode_tps=decode, steps=0, tokens_in_last_step=0,
                policy="remote", seqs=seqs, kv_usage=self.scraped["kv"], external_requests=external))

    async def _scrape_loop(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        while True:
            await asyncio.sleep(SCRAPE_INTERVAL)
            if not self.ready:
                continue
            try:
                r = await self.client.get("/metrics", timeout=3)
                families = list(text_string_to_metric_families(r.text)) if r.status_code == 200 else []
            except (httpx.HTTPError, ValueError):
                families = []
            values: dict[str, float] = {}
            for fam in families:
                for s in fam.samples:
                    values[s.name] = values.get(s.name, 0.0) + s.value
            for key, names in SCRAPE_NAMES.items():
                found = [values[n] for n in names if n in values]
                self.scraped[key] = found[0] if found else None
            if self.scraped["kv"] is not None:
                workers = sum(1 for fam in families if fam.name in SCRAPE_NAMES["kv"] for _ in fam.samples)
                self.scraped["kv"] /= max(1, workers)    # a mean over the server's own workers


class _RemoteFailed(Exception):
    pass


def _logprob_entries(block, top: int) -> list[tuple[str, float, tuple[tuple[str, float], ...]]]:
    """(token text, logprob, top alternatives) per token from a chunk's logprobs, in OpenAI's chat
    shape ({"content": [{"token", "logprob", "top_logprobs": [...]}]}, which llama.cpp also uses
    for completions) or its completions shape ({"tokens", "token_logprobs", "top_logprobs"})."""
    if not isinstance(block, dict):
        return []
    out = []
    if isinstance(block.get("content"), list):
        for e in block["content"]:
            tops = tuple((t.get("token", ""), float(t["logprob"])) for t in e.get("top_logprobs") or ()
                         if t.get("logprob") is not None)
            out.append((e.get("token", ""), float(e["logprob"]) if e.get("logprob") is not None else None,
                        tops[:top]))
    elif isinstance(block.get("tokens"), list):
        lps = block.get("token_logprobs") or []
        alts = block.get("top_logprobs") or []
        for i, t in enumerate(block["tokens"]):
            alt = alts[i] if i < len(alts) and isinstance(alts[i], dict) else {}
            ranked = sorted(alt.items(), key=lambda kv: -kv[1])
            out.append((t, float(lps[i]) if i < len(lps) and lps[i] is not None else None,
                        tuple((s, float(v)) for s, v in ranked)[:top]))
    return out


def _token_count(body) -> int:
    """A /tokenize answer's token count: {"count": N} (vLLM, tokentop) or {"tokens": [...]}."""
    if isinstance(body, dict):
        if isinstance(body.get("count"), int):
            return body["count"]
        if isinstance(body.get("tokens"), list):
            return len(body["tokens"])
    return 0


class RemoteTokenCounter:
    """A prompt's length on a remote that serves another model, asked of its /tokenize by the
    facade at submit (the caller's thread; never under the facade's lock), with a short timeout.
    Answers are cached; after a failure it stays quiet for TOKENIZE_BACKOFF and the caller uses
    the labelled estimate."""

    def __init__(self, url: str):
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=TOKENIZE_TIMEOUT)
        self.cache: dict[tuple, int] = {}
        self.quiet_until = 0.0
        self.last_error = ""
        self.lock = threading.Lock()

    def count(self, shape: str, model: str | None, text: str, messages: tuple | None,
              timeout: float = TOKENIZE_TIMEOUT) -> int:
        """The token count, or raises OSError/httpx.HTTPError/ValueError with the reason."""
        key = (shape, model, text if messages is None else json.dumps(messages, sort_keys=True))
        with self.lock:
            if key in self.cache:
                return self.cache[key]
            if time.monotonic() < self.quiet_until:
                raise ValueError(f"{self.last_error}; asked again after a pause")
        if timeout <= 0:
            raise ValueError("no time left to ask (other remotes took it)")
        deadline = time.monotonic() + timeout
        try:
            n = self._ask(shape, model, text, messages, deadline)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            with self.lock:
                self.quiet_until = time.monotonic() + TOKENIZE_BACKOFF
                self.last_error = _reason(exc)
            raise ValueError(_reason(exc)) from None
        with self.lock:
            if len(self.cache) >= TOKENIZE_CACHE:
                self.cache.pop(next(iter(self.cache)))
            self.cache[key] = n
        return n

    def _post(self, path: str, body: dict, deadline: float) -> dict:
        left = deadline - time.monotonic()
        if left <= 0:
            raise httpx.TimeoutException("no time left")
        r = self.client.post(path, json=body, timeout=left)
        if r.status_code != 200:
            raise ValueError(f"{path} answered {r.status_code}")
        return r.json()

    def _ask(self, shape, model, text, messages, deadline) -> int:
        if shape == TOKENIZE_OPENAI:
            body = {"model": model, "prompt": text} if messages is None else \
                {"model": model, "messages": list(messages), "add_generation_prompt": True}
            n = _token_count(self._post("/tokenize", body, deadline))
        elif shape == TOKENIZE_LLAMACPP:
            if messages is not None:   # its chat template, as its chat endpoint applies it
                text = self._post("/apply-template", {"messages": list(messages)}, deadline)["prompt"]
            n = _token_count(self._post("/tokenize", {"content": text, "add_special": True}, deadline))
        else:
            raise ValueError("the remote has no /tokenize")
        if n <= 0:
            raise ValueError("/tokenize counted no tokens")
        return n

    def close(self) -> None:
        self.client.close()


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0]


async def _error_text(r: httpx.Response) -> str:
    raw = await r.aread()
    try:
        err = json.loads(raw).get("error")
        return (err.get("message") if isinstance(err, dict) else str(err)) or raw.decode()[:200]
    except (ValueError, AttributeError):
        return raw.decode("utf-8", "replace")[:200]


def remote_worker_main(index: int, cfg: WorkerConfig, model_path: str, commands, events) -> None:
    """Thread entry, like worker_main: never raises; death is an event."""
    try:
        RemoteWorker(index, cfg, model_path, commands, events).run()
    except BaseException as exc:  # noqa: BLE001
        events.put(msg.WorkerDead(index, describe_error(exc)))
