"""Connecting to a remote server and finding out what it is: health, model, context, /tokenize.

A probe asks GET /health (200 = up), GET /v1/models (the model it serves, its context: vLLM
and tokentop say max_model_len, llama.cpp's server meta.n_ctx), then, for a server of another
model, which /tokenize shape it has (engine/remote/tokens.py). After a stalled stream the
worker is degraded, and a probe must also see one token generated within the read timeout
before it is admitted again: /health alone answers while generation hangs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from engine import messages as msg
from engine.config import WorkerConfig
from engine.remote.spec import Secret
from engine.remote.tokens import (TOKENIZE_LLAMACPP, TOKENIZE_NONE, TOKENIZE_OPENAI, TOKENIZE_SAME, reason,
                                  token_count)

PROBE_TEXT = "Hello, world"
PROBE_TIMEOUT = 3.0


@dataclass
class Facts:
    """What the last successful probe found."""
    remote_model: str | None = None
    same_model: bool = False       # it serves the model the facade tokenizes with
    tokenize: str = TOKENIZE_NONE
    owned_by: str = ""             # /v1/models' owned_by ("llamacpp" for llama.cpp's server)
    max_context: int = 0


class Connection:
    def __init__(self, cfg: WorkerConfig, url: str, client: httpx.AsyncClient, secret: Secret):
        self.cfg, self.url, self.client, self.secret = cfg, url, client, secret
        self.facts = Facts(max_context=cfg.max_context)

    async def probe(self, generate: bool = False) -> str | None:
        """None when the server is fit to serve (facts updated), else what is wrong."""
        try:
            health = await self.client.get("/health", timeout=PROBE_TIMEOUT)
            if health.status_code != 200:
                return f"{self.url}/health answers {health.status_code}"
            r = await self.client.get("/v1/models", timeout=PROBE_TIMEOUT)
            if r.status_code in (401, 403):
                return self.secret.refused(self.url, r.status_code)
            models = r.json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            return f"cannot reach {self.url}: {self.secret.redact(reason(exc))}"
        ids = [m.get("id") for m in models]
        if not ids:
            return f"{self.url}/v1/models lists no model"
        f = self.facts
        mine = [n for n in (self.cfg.model, Path(self.cfg.model).stem) if n in ids]
        f.same_model = bool(mine)
        f.remote_model = mine[0] if mine else ids[0]
        entry = next(m for m in models if m.get("id") == f.remote_model)
        f.owned_by = str(entry.get("owned_by") or "")
        f.tokenize = TOKENIZE_SAME if f.same_model else await self._probe_tokenize()
        ctx = entry.get("max_model_len") or (entry.get("meta") or {}).get("n_ctx")
        f.max_context = int(ctx) if isinstance(ctx, int) and ctx > 0 else self.cfg.max_context
        if generate:
            return await self._probe_generate()
        return None

    async def _probe_tokenize(self) -> str:
        """Which /tokenize the server has, asked once per admission: vLLM's (and tokentop's)
        shape first; llama.cpp's answers that one with no tokens (it reads only "content")."""
        for shape, body in ((TOKENIZE_OPENAI, {"model": self.facts.remote_model, "prompt": PROBE_TEXT}),
                            (TOKENIZE_LLAMACPP, {"content": PROBE_TEXT})):
            try:
                r = await self.client.post("/tokenize", json=body, timeout=PROBE_TIMEOUT)
                if r.status_code == 404:
                    return TOKENIZE_NONE
                if r.status_code == 200 and token_count(r.json()):
                    return shape
            except (httpx.HTTPError, ValueError, AttributeError):
                return TOKENIZE_NONE
        return TOKENIZE_NONE

    async def _probe_generate(self) -> str | None:
        """One token, within the read timeout: the server generates again."""
        body = {"model": self.facts.remote_model, "prompt": PROBE_TEXT, "max_tokens": 1, "temperature": 0}
        try:
            r = await self.client.post("/v1/completions", json=body)
            if r.status_code != 200:
                return f"{self.url} still fails to generate ({r.status_code})"
        except httpx.TimeoutException:
            return (f"{self.url} still generates nothing within read_timeout="
                    f"{self.cfg.remote_options.read_timeout:g} s")
        except httpx.HTTPError as exc:
            return f"cannot reach {self.url}: {self.secret.redact(reason(exc))}"
        return None

    def info(self, prefill_tps: float, decode_tps: float) -> msg.WorkerInfo:
        f = self.facts
        note = {TOKENIZE_SAME: "prompt lengths: local tokenizer (same model)",
                TOKENIZE_OPENAI: f"prompt lengths: the remote's /tokenize (it serves {f.remote_model})",
                TOKENIZE_LLAMACPP: f"prompt lengths: the remote's /tokenize (llama.cpp; it serves "
                                   f"{f.remote_model})"}.get(
            f.tokenize, f"prompt lengths: estimate (local {self.cfg.model} tokenizer; remote serves "
                        f"{f.remote_model} and has no /tokenize)")
        return msg.WorkerInfo(
            name=self.cfg.name, model=f.remote_model, dtype="remote", pages=0,
            page_size=0, max_context=f.max_context, device=self.cfg.device, simulated=False,
            remote=True, url=self.url, max_active=self.cfg.max_active, policy="remote", note=note,
            tokenize=f.tokenize, profile_prefill_tps=prefill_tps, profile_decode_tps=decode_tps,
            summary=f"forwarding to {self.url} ({f.remote_model}; {note})")
