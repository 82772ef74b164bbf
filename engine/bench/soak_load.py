"""The soak's load (engine/bench/soak.py): HTTP clients sending streaming and whole completions
and chats, some leaving early, and bursts submitted in process, some aborted. Each request is
opened in the ledger when sent and closed with its outcome (engine/bench/soak_checks.py)."""
from __future__ import annotations

import asyncio
import json
import random
from typing import Callable

import httpx

from engine.bench.soak_checks import ABORTED, DISCONNECTED, FAILED, FINISHED, Ledger
from engine.config import SamplingParams
from engine.errors import TokentopError, describe_error

BURST_EVERY_S = 3.0
BURST_SIZE = (3, 6)
MAX_TOKENS = (4, 32)
STREAM_DISCONNECT = 0.2     # share of streams the client leaves after a few chunks
WHOLE_DISCONNECT = 0.1      # share of whole answers the client stops waiting for
ABORT_NOW, ABORT_AFTER_FIRST = 0.15, 0.15   # in-process requests aborted at once / after a token
SHARED = ("The service log below covers one hour of a scheduler that admits requests in arrival "
          "order and preempts the youngest when its pages run out. ")


class SoakClients:
    """The load's clients, over one engine and its HTTP server; `now` is the run's clock."""

    def __init__(self, engine, model_name: str, ledger: Ledger, now: Callable[[], float]):
        self.engine, self.model_name, self.ledger, self.now = engine, model_name, ledger, now

    def _prompt(self, rng: random.Random, n: int) -> str:
        if rng.random() < 0.5:   # a shared start: the prefix cache keeps its pages
            return SHARED + f"Question {n}: what happened at minute {rng.randint(0, 59)}?"
        return f"Request {n}: summarise item {rng.randint(0, 10**6)} of the queue in a few words."

    async def http_client(self, client: httpx.AsyncClient, i: int, stop: asyncio.Event) -> None:
        rng = random.Random(i)
        n = 0
        while not stop.is_set():
            chat, stream = n % 2 == 1, n % 4 < 2
            n += 1
            await self.one_http(client, rng, chat, stream)
            await asyncio.sleep(rng.uniform(0, 0.2))

    async def one_http(self, client, rng: random.Random, chat: bool, stream: bool) -> None:
        max_tokens = rng.randint(*MAX_TOKENS)
        number = self.ledger.open(f"HTTP {'chat' if chat else 'completion'}{', streamed' if stream else ''}, "
                                  f"{max_tokens} tokens, sent at {self.now()} s")
        prompt = self._prompt(rng, number)
        body = {"model": self.model_name, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            if stream:
                leave = rng.randint(1, 4) if rng.random() < STREAM_DISCONNECT else 0
                body.update(stream=True, stream_options={"include_usage": True})
                outcome, reason, length = await stream_request(client, path, body, number, leave, self.ledger)
            else:
                leave = rng.uniform(0.05, 0.6) if rng.random() < WHOLE_DISCONNECT else 0
                outcome, reason, length = await whole_request(client, path, body, leave)
        except (httpx.HTTPError, ValueError, KeyError, AttributeError) as exc:
            outcome, reason, length = FAILED, f"client: {describe_error(exc)}", None
        self.ledger.close(number, outcome, reason)
        if length is not None:
            self._check_length(number, max_tokens, *length)

    def _check_length(self, number: int, asked: int, finish: str, got: int, counted: int | None) -> None:
        """ignore_eos: a finished request ends by length with exactly the tokens it asked for."""
        if finish != "length" or got != asked or counted not in (None, asked):
            self.ledger.wrong_length(number, f"finish {finish!r} with {got} tokens streamed and {counted} "
                                             f"counted; asked for {asked}")

    async def bursts(self, stop: asyncio.Event) -> None:
        rng = random.Random(1000)
        running: set[asyncio.Future] = set()
        while not stop.is_set():
            for _ in range(rng.randint(*BURST_SIZE)):
                task = asyncio.ensure_future(self.one_in_process(rng))
                running.add(task)
                task.add_done_callback(running.discard)
            try:
                await asyncio.wait_for(stop.wait(), BURST_EVERY_S)
            except TimeoutError:
                pass
        await asyncio.gather(*running)

    async def one_in_process(self, rng: random.Random) -> None:
        from engine.facade.requests import RequestFailed

        max_tokens = rng.randint(*MAX_TOKENS)
        number = self.ledger.open(f"in process, {max_tokens} tokens, sent at {self.now()} s")
        roll = rng.random()
        abort_now, abort_first = roll < ABORT_NOW, ABORT_NOW <= roll < ABORT_NOW + ABORT_AFTER_FIRST
        try:
            handle = self.engine.submit(self._prompt(rng, number), burst="soak",
                                        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        except TokentopError as exc:
            self.ledger.close(number, FAILED, f"refused: {describe_error(exc)}")
            return
        self.ledger.describe(number, f"in process {handle.id}, {max_tokens} tokens, sent at {self.now()} s"
                                     + (", aborted at once" if abort_now else ", aborted after a token" if abort_first else ""))
        if abort_now:
            handle.abort()
        tokens = 0
        try:
            async for d in handle:
                tokens += d.token_id >= 0
                if abort_first and tokens == 1:
                    handle.abort()
        except RequestFailed:
            pass
        res = handle.result(0)
        if res.finish_reason == "abort":
            self.ledger.close(number, ABORTED)
        elif res.finish_reason == "error":
            self.ledger.close(number, FAILED, res.error or "no reason given")
        else:
            self.ledger.close(number, FINISHED)
            self._check_length(number, max_tokens, res.finish_reason, tokens, len(res.token_ids))


async def stream_request(client, path: str, body: dict, number: int, leave: int, ledger: Ledger):
    """(outcome, reason, (finish, tokens streamed, tokens counted) or None)."""
    tokens, chunks, finish, usage, done, error = 0, 0, None, None, False, None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return FAILED, f"HTTP {r.status_code}: {error_message(await r.aread())}", None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if done:
                ledger.streamed_after_finish(number, "data after [DONE]")
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"].get("message") or "an error chunk without a message"
                continue
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                if finish is not None:
                    ledger.streamed_after_finish(number, "a chunk")
                tokens += len(choice.get("token_ids") or ())
                finish = choice.get("finish_reason") or finish
            chunks += 1
            if leave and chunks >= leave and finish is None and error is None:
                return DISCONNECTED, "", None      # leaving the block drops the connection
    if error is not None:
        return FAILED, error, None
    if finish is None or not done:
        return FAILED, "the stream ended without a finish reason and [DONE]", None
    return FINISHED, "", (finish, tokens, (usage or {}).get("completion_tokens"))

async def whole_request(client, path: str, body: dict, leave: float):
    try:
        r = await asyncio.wait_for(client.post(path, json=body), leave or None)
    except TimeoutError:
        return DISCONNECTED, "", None               # cancelled: the connection is dropped
    if r.status_code != 200:
        return FAILED, f"HTTP {r.status_code}: {error_message(r.content)}", None
    answer = r.json()
    choice = answer["choices"][0]
    return FINISHED, "", (choice["finish_reason"], len(choice.get("token_ids") or ()),
                          (answer.get("usage") or {}).get("completion_tokens"))


def error_message(raw: bytes) -> str:
    """The message of an HTTP error body, or its first 200 characters."""
    try:
        err = json.loads(raw).get("error")
        return (err.get("message") if isinstance(err, dict) else str(err)) or raw.decode()[:200]
    except (ValueError, AttributeError):
        return raw.decode("utf-8", "replace")[:200]
