"""One routed request on a remote server: the streaming POST, its tokens back as StepEvents.

* Prompts. When the server serves the model the facade tokenized with (same model id), the
  prompt goes as token ids to /v1/completions: exact, and chat templates applied once. Else
  chat messages go to /v1/chat/completions and plain prompts as text.
* Logprobs. Asked of the server when the client asked (logprobs / top_logprobs; llama.cpp's
  n_probs too) and passed back by token text, in either of OpenAI's two shapes.
* Rates. Prefill tok/s = prompt tokens / TTFT and decode tok/s = tokens / time after the first,
  measured on every stream and smoothed; they replace the nominal rates in the cost router.
* Failure. A refused or dropped connection marks the worker down; a stream silent for longer
  than read_timeout marks it degraded. Either way a request that streamed nothing yet is
  rerouted by the facade; one that had, fails with the reason. Aborting a request closes its
  stream, which the server sees as a disconnect.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

import httpx

from engine import messages as msg
from engine.remote.probe import Connection
from engine.remote.tokens import TOKENIZE_LLAMACPP, reason

SMOOTHING = 0.3           # weight of the newest measurement in the smoothed rates


class RemoteFailed(Exception):
    pass


class Forwarder:
    def __init__(self, index: int, conn: Connection, tokenizer, emit: Callable,
                 mark_down: Callable[[str], None], mark_degraded: Callable[[str], None]):
        self.index, self.conn, self.tokenizer, self.emit = index, conn, tokenizer, emit
        self.mark_down, self.mark_degraded = mark_down, mark_degraded
        self.streamed: dict[str, int] = {}      # request id -> tokens streamed so far
        self.prompt_len: dict[str, int] = {}
        self.history: list[tuple[float, int]] = []   # (time, tokens) of recent chunks
        self.prefill_tps = 0.0
        self.decode_tps = 0.0

    @property
    def name(self) -> str:
        return self.conn.cfg.name

    def open(self, cmd: msg.Submit) -> None:
        self.streamed[cmd.request_id] = 0
        self.prompt_len[cmd.request_id] = cmd.prompt_tokens or len(cmd.prompt_ids)

    async def forward(self, cmd: msg.Submit) -> None:
        rid, url, redact = cmd.request_id, self.conn.url, self.conn.secret.redact
        sent = time.monotonic()
        first = None
        n_out, usage, finish = 0, None, None
        try:
            path, body = self.body(cmd)
            async with self.conn.client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    self._refused(cmd, r.status_code, redact(await _error_text(r)), sent)
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
                        raise RemoteFailed(err.get("message") if isinstance(err, dict) else str(err))
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        deltas = self._choice_deltas(rid, choice, cmd.params.logprobs)
                        if deltas:
                            first = first or time.monotonic()
                            n_out += len(deltas)
                            self.streamed[rid] = n_out
                            self.history.append((time.monotonic(), len(deltas)))
                            self.emit(msg.StepEvents(self.index, tuple(deltas), ()))
                        finish = choice.get("finish_reason") or finish
            if usage and usage.get("completion_tokens") is not None:
                n_out = usage["completion_tokens"]
            prompt_tokens = (usage or {}).get("prompt_tokens") or cmd.prompt_tokens or len(cmd.prompt_ids)
            self._measure(prompt_tokens, sent, first, n_out)
            self._finish(cmd, finish if finish in ("stop", "length") else "stop", None, sent, first, n_out,
                         prompt_tokens)
        except asyncio.CancelledError:
            self._finish(cmd, "abort", None, sent, first, n_out)
        except httpx.ReadTimeout:
            t = self.conn.cfg.remote_options.read_timeout
            why = f"no data from {url} for {t:g} s (read_timeout={t:g}): the stream stalled"
            self.mark_degraded(why)
            self._lost(cmd, why, sent, first, n_out)
        except (httpx.HTTPError, OSError) as exc:
            why = f"lost {url}: {redact(reason(exc))}"
            self.mark_down(why)
            self._lost(cmd, why, sent, first, n_out)
        except (RemoteFailed, ValueError, KeyError, TypeError) as exc:
            self._finish(cmd, "error", f"remote worker {self.name}: {redact(str(exc))}", sent, first, n_out)
        finally:
            self.streamed.pop(rid, None)
            self.prompt_len.pop(rid, None)

    def never_started(self, cmd: msg.Submit) -> None:
        """A forward cancelled before its first step (an Abort handled right behind its Submit)
        never ran its body, which reports the abort and forgets the request: do both here."""
        if cmd.request_id in self.streamed:     # the body's `finally` would have removed it
            self.streamed.pop(cmd.request_id, None)
            self.prompt_len.pop(cmd.request_id, None)
            self._finish(cmd, "abort", None, time.monotonic(), None, 0)

    def _refused(self, cmd: msg.Submit, status: int, detail: str, sent: float) -> None:
        url = self.conn.url
        if status in (401, 403):
            why = self.conn.secret.refused(url, status)
            self.mark_down(why)
            self.emit(msg.Reroute(self.index, cmd.request_id, why))
        elif status in (429, 503) or status >= 500:
            if status >= 500 and status != 503:
                self.mark_down(f"{url} answered {status}: {detail}")
            self.emit(msg.Reroute(self.index, cmd.request_id, f"{url} answered {status}: {detail}"))
        else:
            self._finish(cmd, "error", f"{url} refused the request ({status}): {detail}", sent, None, 0)

    def _lost(self, cmd: msg.Submit, why: str, sent: float, first, n_out: int) -> None:
        """The connection failed: a request that streamed nothing goes elsewhere, others fail."""
        if self.streamed.get(cmd.request_id):
            self._finish(cmd, "error", f"remote worker {self.name} failed mid-stream ({why})", sent, first, n_out)
        else:
            self.emit(msg.Reroute(self.index, cmd.request_id, why))

    # --- the request body -----------------------------------------------------------------
    def body(self, cmd: msg.Submit) -> tuple[str, dict]:
        p, f = cmd.params, self.conn.facts
        body = {"model": f.remote_model, "max_tokens": p.max_tokens, "temperature": p.temperature,
                "top_p": p.top_p, "stream": True, "stream_options": {"include_usage": True}}
        for name, value, off in (("top_k", p.top_k, 0), ("min_p", p.min_p, 0.0),
                                 ("repetition_penalty", p.repetition_penalty, 1.0),
                                 ("presence_penalty", p.presence_penalty, 0.0),
                                 ("frequency_penalty", p.frequency_penalty, 0.0)):
            if value != off:
                body[name] = value
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if p.ignore_eos:
            body["ignore_eos"] = True
        if p.cache_salt is not None:
            body["cache_salt"] = p.cache_salt        # vLLM's and tokentop's name
        if p.stop_token_ids and f.same_model:         # ids of our vocabulary: only where it is theirs
            body["stop_token_ids"] = list(p.stop_token_ids)
        chat = not f.same_model and cmd.messages is not None
        if p.return_logprobs:
            # llama.cpp sends logprobs only for at least one alternative (its n_probs, which its
            # chat endpoint takes from top_logprobs): ask for one, pass back the number asked
            llama = f.tokenize == TOKENIZE_LLAMACPP or f.owned_by == "llamacpp"
            top = max(1, p.logprobs) if llama else p.logprobs
            if chat:
                body["logprobs"], body["top_logprobs"] = True, top
            else:
                body["logprobs"] = p.logprobs
                if llama:
                    body["n_probs"] = top    # its completions endpoint reads only this name
        if f.same_model:
            # the exact tokens, template applied once, here; ask for the generated ids back
            return "/v1/completions", {**body, "prompt": list(cmd.prompt_ids), "return_token_ids": True}
        if chat:
            return "/v1/chat/completions", {**body, "messages": list(cmd.messages)}
        return "/v1/completions", {**body, "prompt": self.tokenizer.decode(list(cmd.prompt_ids))}

    # --- what comes back -------------------------------------------------------------------
    def _choice_deltas(self, rid: str, choice: dict, top: int) -> list[msg.TokenDelta]:
        """One delta per token of a chunk (the chunk's text on the first): its id where the server
        returned ids (same model), else -1; its logprob by token text where it sent logprobs."""
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content") or ""
        ids = choice.get("token_ids") or []
        lps = logprob_entries(choice.get("logprobs"), top)
        n = max(len(ids), len(lps), 1 if text else 0)
        out = []
        for i in range(n):
            lp = lps[i] if i < len(lps) else None
            out.append(msg.TokenDelta(rid, ids[i] if i < len(ids) else -1, text if i == 0 else "",
                                      lp[1] if lp else None, (), token_str=lp[0] if lp else None,
                                      top_strs=lp[2] if lp else ()))
        return out

    def _finish(self, cmd, reason_, error, sent, first, n_out, prompt_tokens=None) -> None:
        now = time.monotonic()
        m = msg.RequestMetrics(
            prompt_tokens=prompt_tokens or cmd.prompt_tokens or len(cmd.prompt_ids), cached_tokens=0,
            output_tokens=n_out, queue_time=sent - cmd.arrival,
            ttft=None if first is None else first - cmd.arrival,
            itl_mean=(now - first) / (n_out - 1) if first is not None and n_out > 1 else None,
            itl_max=None, e2e=now - cmd.arrival)
        self.emit(msg.StepEvents(self.index, (), (msg.Finished(cmd.request_id, reason_, error, m),)))

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


def logprob_entries(block, top: int) -> list[tuple[str, float, tuple[tuple[str, float], ...]]]:
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


async def _error_text(r: httpx.Response) -> str:
    raw = await r.aread()
    try:
        err = json.loads(raw).get("error")
        return (err.get("message") if isinstance(err, dict) else str(err)) or raw.decode()[:200]
    except (ValueError, AttributeError):
        return raw.decode("utf-8", "replace")[:200]
