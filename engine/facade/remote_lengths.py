"""Prompt lengths on remote workers that serve another model: their own tokenizer's count,
asked over HTTP (their /tokenize), or the local count labelled an estimate."""
from __future__ import annotations

import time


class RemotePromptLengths:
    def __init__(self, engine):
        self.engine = engine   # the facade: its workers, lock, tokenizer and event log
        self.counters: dict = {}   # remote worker index -> RemoteTokenCounter (engine/remote/worker.py)

    def close(self) -> None:
        for counter in self.counters.values():
            counter.close()

    def needed(self) -> bool:
        """Whether lengths() would ask a remote server (and may take up to its timeout)."""
        return any(shape for _, shape, _ in self._other_model_remotes())

    def _other_model_remotes(self) -> list[tuple[int, str, str]]:
        """(index, /tokenize shape or "" for none, model) of each ready remote of another model."""
        if not self.counters:        # no remote workers (and engine.remote, httpx, not imported)
            return []
        from engine.remote.tokens import TOKENIZE_SAME

        with self.engine.lock:
            return [(w.index, w.info.tokenize, w.info.model) for w in self.engine.workers.ready()
                    if w.cfg.remote and w.info.tokenize != TOKENIZE_SAME]

    def lengths(self, ids: list[int], messages: list[dict] | None = None) -> dict[int, tuple[int, str]]:
        """The prompt's length on each ready remote worker that serves another model, and where
        the figure comes from: "remote" (its /tokenize) or "estimate" (the local count, when it has
        no /tokenize or the call failed or timed out). Workers not listed count len(ids) ("local").
        Asks the remotes over HTTP (bounded by engine/remote/tokens.py TOKENIZE_TIMEOUT in all): call it
        outside any event loop."""
        out: dict[int, tuple[int, str]] = {}
        remotes = self._other_model_remotes()
        if not remotes:
            return out
        from engine.remote.tokens import TOKENIZE_TIMEOUT

        text = self.engine.tokenizer.decode(list(ids)) if messages is None else ""   # what the remote is sent
        deadline = time.monotonic() + TOKENIZE_TIMEOUT
        for index, shape, model in remotes:
            if not shape:
                out[index] = (len(ids), "estimate")
                continue
            try:
                n = self.counters[index].count(shape, model, text,
                                                tuple(messages) if messages is not None else None,
                                                max(0.0, deadline - time.monotonic()))
                out[index] = (n, "remote")
            except ValueError as exc:
                out[index] = (len(ids), "estimate")
                self.engine.event_log.repeated(("tokenize failed", index), "warning",
                                        f"worker {index}: prompt length estimated locally, its /tokenize "
                                        f"failed: {exc}{{times}}")
        return out
