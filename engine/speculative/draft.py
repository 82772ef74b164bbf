"""A small draft model on the target's worker: same tokenizer, own K/V over the same pages.

The draft's K/V live in a second store indexed by the same slot numbers as the target's;
each request keeps a draft block table (Sequence.draft_table) of pages taken from the
worker's pool, so the scheduler's page accounting sees them, preemption and finishing free
them, and a rejected proposal rolls them back with the target's (controller.settle).

A round for requests R with draft lengths k_r:
  1. catch-up: one flat batch with every token the draft has not seen yet (the whole prompt
     the first time, then the one or two tokens the last round emitted); its last row
     gives d_1
  2. k - 1 decode steps over the requests that still draft, each giving the next d_j
Greedy requests draft the argmax; sampled ones draw d_j ~ q_j, where q_j is what sample()
would draw from the draft's logits under the request's own settings (penalties included),
from a generator of their own so the target's random stream is untouched.
"""
from __future__ import annotations

import time

import torch

from engine.errors import ConfigError
from engine.models.batch import ForwardBatch, SeqSlice
from engine.worker.sampling import draw_from, probs_for
from engine.speculative.policy import CURRENT_CATCHUP
from engine.trace import get_tracer


def check_vocab(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Refuse a pair whose token ids do not mean the same text."""
    t, d = target_tok._tokens, draft_tok._tokens
    same = len(t) == len(d) and t == d and target_tok.eog_ids == draft_tok.eog_ids
    if not same:
        diff = next((i for i, (a, b) in enumerate(zip(t, d)) if a != b), min(len(t), len(d)))
        raise ConfigError(
            f"draft model {draft_name!r} cannot draft for {target_name!r}: their vocabularies differ "
            f"({len(d)} vs {len(t)} tokens, first difference at id {diff}). Pick a draft of the same "
            "family, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b.")


class DraftModel:
    def __init__(self, cfg, path: str, policy, target_tokenizer, target_vocab: int):
        from engine.models.decoder import Decoder
        from engine.models.gguf import load_gguf
        from engine.models.tokenizer import Tokenizer

        gf = load_gguf(path)
        self.name = cfg.draft_model
        self.tokenizer = Tokenizer.from_gguf(path, gf.metadata)
        check_vocab(target_tokenizer, self.tokenizer, cfg.model, cfg.draft_model)
        if gf.config.vocab_size > target_vocab:
            raise ConfigError(f"draft model {cfg.draft_model!r} scores {gf.config.vocab_size} tokens, "
                              f"more than the target {cfg.model!r} ({target_vocab}); pick another draft")
        self.target_vocab = target_vocab
        self.config = gf.config
        self.model = Decoder.from_gguf(gf, policy)
        from engine.dtypes import resolve_kv_dtype
        from engine.models.batch import KV_TORCH_DTYPES
        self.kv_dtype = KV_TORCH_DTYPES[resolve_kv_dtype(cfg.device, cfg.kv_dtype)]
        from engine.models.batch import KVStore
        self.bytes_per_slot = KVStore.bytes_per_slot(gf.config.n_layers, gf.config.n_kv_heads,
                                                     gf.config.head_dim, self.kv_dtype)
        self.kv = None
        self.last_catchup = (0, 0.0)   # (tokens, seconds) of the last round's catch-up step

    def allocate_kv(self, num_slots: int) -> None:
        self.kv = self.model.new_kv_store(num_slots, dtype=self.kv_dtype)

    @torch.inference_mode()
    def propose(self, requests: list, blocks) -> tuple[dict, list]:
        """requests: [(seq, k)]. Returns ({seq id: (drafts, q [k, V] or None)}, timings), with
        timings [(rows, seconds)] of the steps that cost what one more draft token costs: those
        after the first, and the first when its catch-up is at most CURRENT_CATCHUP tokens a
        request (the last round's, as when drafting every round; without it, k = 1 rounds would
        never be timed, and the cost model would price them from a stale table)."""
        tracer = get_tracer()
        live = []
        for seq, k in requests:
            # every position the draft writes this round: known tokens, then d_1..d_{k-1}
            if blocks.grow_draft(seq, seq.num_tokens + k - 1):
                live.append([seq, k, [], []])
        out = {}
        timings = []
        catchup = sum(r[0].num_tokens - r[0].draft_computed for r in live)
        self.last_catchup = (0, 0.0)
        if not live:
            return out, timings
        saved = {id(r[0]): dict(r[0].sampler.generated_counts) for r in live}
        try:
            step = 0
            while live:
                t0 = time.perf_counter()
                with tracer.scope("draft step", step=step, requests=len(live)):
                    logits = self._forward(live, blocks, first=step == 0)
                for row, r in enumerate(live):
                    seq = r[0]
                    tok, q = self._draw(logits[row], seq)
                    r[2].append(tok)
                    if q is not None:
                        r[3].append(q)
                    seq.sampler.observe(tok)   # the next draft sees this one's penalties
                still = []
                for r in live:
                    if len(r[2]) >= r[1]:
                        out[r[0].id] = (r[2], torch.stack(r[3]) if r[3] else None)
                    else:
                        still.append(r)
                seconds = time.perf_counter() - t0
                if step or catchup <= CURRENT_CATCHUP * len(live):
                    timings.append((len(live), seconds))
                if not step:
                    self.last_catchup = (catchup, seconds)
                live = still
                step += 1
        finally:
            for seq, _ in requests:
                if id(seq) in saved:
                    seq.sampler.generated_counts = saved[id(seq)]
                    seq.sampler._penalty_index = None
        return out, timings

    def _forward(self, live: list, blocks, first: bool) -> torch.Tensor:
        token_ids, positions, write_slots, seqs, logits_rows = [], [], [], [], []
        for seq, k, drafts, _ in live:
            row = len(token_ids)
            if first:   # catch up on every known token the draft has not seen
                start, new = seq.draft_computed, seq.prompt_ids + seq.output_ids
                ids = new[start:]
            else:       # the previous draft token
                start, ids = seq.draft_computed, [drafts[-1]]
            n = len(ids)
            token_ids += ids
            positions += range(start, start + n)
            slots = blocks.slots(seq, 0, start + n, draft=True)
            write_slots.append(slots[start:])
            seqs.append(SeqSlice(row, n, start + n, slots, None))
            logits_rows.append(row + n - 1)
            seq.draft_computed = start + n
        batch = ForwardBatch(torch.tensor(token_ids, dtype=torch.int64),
                             torch.tensor(positions, dtype=torch.int64), torch.cat(write_slots),
                             seqs, torch.tensor(logits_rows, dtype=torch.int64))
        return self.model(batch, self.kv)

    def _draw(self, logits_row: torch.Tensor, seq) -> tuple[int, torch.Tensor | None]:
        s = seq.sampler
        if s.params.greedy and not s.has_penalties:
            return int(logits_row.float().argmax()), None
        q = probs_for(logits_row, s)
        if q.shape[-1] < self.target_vocab:
            q = torch.nn.functional.pad(q, (0, self.target_vocab - q.shape[-1]))
        if s.params.greedy:
            return int(q.argmax()), None
        gen = seq.spec.draft_generator(s.seed)
        u = torch.rand((), generator=gen, dtype=torch.float64)
        return int(draw_from(q, u)), q
