"""Prompt lengths on a remote that serves another model: its own /tokenize, asked by the facade.

vLLM's and tokentop's shape: POST /tokenize {"model", "prompt"|"messages"} -> {"count"};
llama.cpp's: {"content"} -> {"tokens"}, with its /apply-template for chat. The probe
(engine/remote/probe.py) finds which one a server has; without one, or when a call fails or
times out, the local count stands in, labelled an estimate.
"""
from __future__ import annotations

import json
import threading
import time

import httpx

from engine.remote.spec import Secret, remote_url

TOKENIZE_TIMEOUT = 0.5    # s: a prompt-length call to a remote's /tokenize, at submit
TOKENIZE_BACKOFF = 10.0   # s: after a failed /tokenize, estimates only for this long
TOKENIZE_CACHE = 512      # prompt lengths kept per remote (a burst repeats its prompts)

# how a remote counts tokens (WorkerInfo.tokenize)
TOKENIZE_SAME = "same-model"      # the local tokenizer is the remote's
TOKENIZE_OPENAI = "tokenize"      # vLLM / tokentop: POST /tokenize {"model", "prompt"|"messages"} -> count
TOKENIZE_LLAMACPP = "tokenize-llamacpp"   # llama.cpp: POST /tokenize {"content"} -> tokens
TOKENIZE_NONE = ""                # none: the local count stands in, labelled an estimate


def token_count(body) -> int:
    """A /tokenize answer's token count: {"count": N} (vLLM, tokentop) or {"tokens": [...]}."""
    if isinstance(body, dict):
        if isinstance(body.get("count"), int):
            return body["count"]
        if isinstance(body.get("tokens"), list):
            return len(body["tokens"])
    return 0


def reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0]


def counter_for(cfg) -> RemoteTokenCounter:
    """The counter of a remote worker's config (engine/worker_kinds.py's `token_counter`)."""
    return RemoteTokenCounter(remote_url(cfg), Secret(cfg.remote_options))


class RemoteTokenCounter:
    """A prompt's length on a remote that serves another model, asked of its /tokenize by the
    facade at submit (the caller's thread; never under the facade's lock), with a short timeout.
    Answers are cached; after a failure it stays quiet for TOKENIZE_BACKOFF and the caller uses
    the labelled estimate."""

    def __init__(self, url: str, secret: Secret | None = None):
        self.url = url
        self.secret = secret
        self.client = httpx.Client(base_url=url, timeout=TOKENIZE_TIMEOUT,
                                   **(secret.client_kwargs() if secret else {}))
        self.cache: dict[tuple, int] = {}
        self.quiet_until = 0.0
        self.last_error = ""
        self.lock = threading.Lock()

    def count(self, shape: str, model: str | None, text: str, messages: tuple | None,
              timeout: float = TOKENIZE_TIMEOUT) -> int:
        """The token count, or raises ValueError with the reason."""
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
            why = self.secret.redact(reason(exc)) if self.secret else reason(exc)
            with self.lock:
                self.quiet_until = time.monotonic() + TOKENIZE_BACKOFF
                self.last_error = why
            raise ValueError(why) from None
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
            n = token_count(self._post("/tokenize", body, deadline))
        elif shape == TOKENIZE_LLAMACPP:
            if messages is not None:   # its chat template, as its chat endpoint applies it
                text = self._post("/apply-template", {"messages": list(messages)}, deadline)["prompt"]
            n = token_count(self._post("/tokenize", {"content": text, "add_special": True}, deadline))
        else:
            raise ValueError("the remote has no /tokenize")
        if n <= 0:
            raise ValueError("/tokenize counted no tokens")
        return n

    def close(self) -> None:
        self.client.close()
