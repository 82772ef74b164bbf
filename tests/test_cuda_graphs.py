"""Captured decode steps (engine/worker/cuda_graphs.py).

Without a GPU: the buckets and padding, the static buffers filled from a ForwardBatch, the
device-side attention plan against plan_attention, and the graph runner's bookkeeping
(capture, replay selection, eager fallbacks) through SimulatedGraphs, a stand-in that
SIMULATES the CUDA graph API on the CPU: its "replay" calls the recorded step function again.
Nothing it does is a measurement. With a GPU (skipped here): the real graphs give the greedy
ids of the eager path, per activation dtype, on a tiny model and on the real 0.5B, and the
captured step makes no host sync before the sampled ids are read.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.models.attention import attend, plan_attention, plan_decode_on_device
from engine.models.batch import ForwardBatch, SeqSlice
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.quant import LinearPolicy
from engine.worker import cuda_graphs
from engine.worker.cuda_graphs import (BATCH_BUCKETS, DecodeGraphs, batch_bucket, key_bucket,
                                       key_buckets)

NO_GPU = not torch.cuda.is_available()
PAGE = 16


class SimulatedGraphs:
    """SIMULATES the CUDA graph API on the CPU for the bookkeeping tests: capture() runs the
    step once (the warm-up) and keeps the function as the "graph"; replay() calls it again,
    which, like a real replay, reads the static inputs and writes the static outputs. No GPU,
    no timing, no memory figure (it reports 0 bytes)."""

    def __init__(self, device=None):
        self.captured: list = []     # the functions, in capture order
        self.replayed = 0

    def capture(self, fn):
        fn()
        self.captured.append(fn)
        return fn

    def replay(self, graph) -> None:
        self.replayed += 1
        graph()

    def copied(self):
        return None

    def memory_reserved(self) -> int:
        return 0

    def pinned(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)


# --- helpers ------------------------------------------------------------------------------

def slots_of(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


def make_batch(chunks: list[tuple[list[int], int, list[int]]], rowwise: bool = False,
               with_pages: bool = True) -> ForwardBatch:
    """chunks: (new tokens, position of the first, the sequence's pages)."""
    ids, pos, write, seqs, rows = [], [], [], [], []
    for new, first, pages in chunks:
        start, ctx = len(ids), first + len(new)
        slots = slots_of(pages)
        ids += new
        pos += range(first, ctx)
        write.append(slots[first:ctx])
        seqs.append(SeqSlice(start, len(new), ctx, slots[:ctx], rowwise=rowwise,
                             pages=pages if with_pages else None))
        rows.append(start + len(new) - 1)
    return ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.cat(write), seqs, torch.tensor(rows))


def random_tables(rng: random.Random, n: int, pages_each: int, pool: int) -> list[list[int]]:
    order = rng.sample(range(pool), n * pages_each)
    return [order[i * pages_each:(i + 1) * pages_each] for i in range(n)]


def tiny_model(path, device="cpu", dtype=torch.float32) -> Decoder:
    """Dense torch linears and torch ops: on the CPU, what a CUDA worker runs."""
    return Decoder.from_gguf(load_gguf(path), LinearPolicy(activation_dtype=dtype, device=device, use_kernels=False))


# --- buckets ------------------------------------------------------------------------------

def test_batch_and_key_buckets():
    assert BATCH_BUCKETS == (1, 2, 4, 8, 16, 32)
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert batch_bucket(33) is None
    assert key_buckets(4096) == (256, 512, 1024, 2048, 4096)
    assert key_buckets(304) == (256, 304) and key_buckets(256) == (256,) and key_buckets(64) == (64,)
    assert key_bucket((256, 512), 1) == 256 and key_bucket((256, 512), 257) == 512
    assert key_bucket((256, 512), 513) is None


# --- the device-side attention plan -------------------------------------------------------

def _visible(plan_slots: torch.Tensor, mask: torch.Tensor | None, lengths: torch.Tensor | None) -> list[list[int]]:
    """Each row's visible key slots, in order, from a DecodeGroup's tensors."""
    rows = []
    for b in range(plan_slots.shape[0]):
        if lengths is not None:
            keep = torch.arange(plan_slots.shape[1]) < lengths[b]
        elif mask is not None:
            keep = mask[b, 0] == 0
        else:
            keep = torch.ones(plan_slots.shape[1], dtype=torch.bool)
        rows.append(plan_slots[b][keep].tolist())
    return rows


@pytest.mark.parametrize("fused", [False, True])
def test_device_plan_equals_plan_attention_on_random_decode_batches(fused):
    rng = random.Random(7)
    for trial in range(60):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13])
        pages_each = 14
        tables = random_tables(rng, n, pages_each, pool=n * pages_each + 9)
        contexts = [rng.randint(1, pages_each * PAGE) for _ in range(n)]
        window = rng.choice([None, None, 8, 32, 100])
        batch = make_batch([([rng.randrange(50)], ctx - 1, t) for ctx, t in zip(contexts, tables)])
        plan = plan_attention(batch, window, fused=fused)
        width = max(min(c, window or c) for c in contexts) + rng.choice([0, 3, 40])
        dev = plan_decode_on_device(torch.tensor(tables), torch.tensor(contexts), PAGE, width, window, fused=fused)
        d = dev.decode
        assert not dev.singles and d.rows is None and d.slots.shape == (n, width)
        got = _visible(d.slots, d.mask, d.lengths)
        if plan.decode is None:          # one decode alone: plan_attention's single path
            (single,) = plan.singles
            want = [single.slots.tolist()]
        else:
            p = plan.decode
            lmax = p.slots.shape[1]
            want = _visible(p.slots, p.mask, p.lengths)
            # the same padded slots, padded further with slot 0
            assert torch.equal(d.slots[:, :lmax], p.slots) and not d.slots[:, lmax:].any()
            if fused:
                assert torch.equal(d.lengths, p.lengths)
        assert got == want, (trial, contexts, window)
        assert (d.mask is None) == fused and (d.lengths is None) != fused


def test_device_plan_attends_as_plan_attention():
    rng = random.Random(3)
    torch.manual_seed(0)
    H, KV, hd, pool = 4, 2, 16, 60
    k_store, v_store = torch.randn(pool * PAGE, KV, hd), torch.randn(pool * PAGE, KV, hd)
    for window in (None, 24):
        tables = random_tables(rng, 5, 10, pool)
        contexts = [rng.randint(1, 160) for _ in tables]
        batch = make_batch([([1], ctx - 1, t) for ctx, t in zip(contexts, tables)])
        q = torch.randn(5, H, hd)
        want = attend(q, k_store, v_store, plan_attention(batch, window))
        dev = plan_decode_on_device(torch.tensor(tables), torch.tensor(contexts), PAGE, 256, window)
        torch.testing.assert_close(attend(q, k_store, v_store, dev), want, rtol=1e-5, atol=1e-5)


def test_device_plan_reads_no_value_on_the_host():
    """On meta tensors (no data at all) any .item(), .tolist() or data-dependent shape would
    raise: the plan is made of tensor ops alone, as a captured graph needs."""
    tables = torch.empty(8, 20, dtype=torch.int64, device="meta")
    contexts = torch.empty(8, dtype=torch.int64, device="meta")
    for fused in (False, True):
        plan = plan_decode_on_device(tables, contexts, PAGE, 320, 64, fused=fused)
        assert plan.decode.slots.shape == (8, 320) and plan.decode.slots.device.type == "meta"


# --- static buffers -----------------------------------------------------------------------

@pytest.fixture
def tiny_qwen(tiny_model_path):
    return tiny_model_path("qwen2", context_length=512)


def _graphs(model, pages=40, max_context=256, api=None) -> DecodeGraphs:
    kv = model.new_kv_store(pages * PAGE + 1)     # one scratch slot past the pool
    return DecodeGraphs(model, kv, PAGE, max_context, pages * PAGE, api or SimulatedGraphs())


def test_fill_pads_the_bucket_with_rows_in_the_scratch_slot(tiny_qwen):
    g = _graphs(tiny_model(tiny_qwen))
    tables = [[3, 7, 1], [0, 2], [10, 12, 5]]
    batch = make_batch([([11], 40, tables[0]), ([22], 17, tables[1]), ([33], 35, tables[2])])
    rows = g.fill(batch, bucket=4, keys=256)
    h = g.host
    assert rows == 4 + 256 // PAGE
    assert h[0, :4].tolist() == [11, 22, 33, 0]                    # token ids, padding 0
    assert h[1, :4].tolist() == [40, 17, 35, 0]                    # positions
    assert h[2, :4].tolist() == [41, 18, 36, 1]                    # keys after the step
    scratch = 40 * PAGE
    assert h[3, :4].tolist() == [1 * PAGE + 8, 2 * PAGE + 1, 5 * PAGE + 3, scratch]   # write slots
    assert h[4:7, 0].tolist() == [3, 7, 1] and h[4:6, 1].tolist() == [0, 2] and h[4:7, 2].tolist() == [10, 12, 5]
    assert h[4, 3] == scratch // PAGE                               # the padded row's one key
    # a smaller batch next: the columns it leaves become padding again
    g.fill(make_batch([([5], 3, [9])]), bucket=1, keys=256)
    assert h[0, 0] == 5 and h[2, 0] == 4 and h[4, 0] == 9


def test_scratch_slot_must_start_a_page_past_the_pool(tiny_qwen):
    model = tiny_model(tiny_qwen)
    with pytest.raises(ValueError, match="scratch slot"):
        DecodeGraphs(model, model.new_kv_store(40 * PAGE), PAGE, 256, 40 * PAGE, SimulatedGraphs())
    with pytest.raises(ValueError, match="scratch slot"):
        DecodeGraphs(model, model.new_kv_store(40 * PAGE + 1), PAGE, 256, 40 * PAGE - 3, SimulatedGraphs())


# --- capture and replay (simulated graph API) ---------------------------------------------

def test_capture_bookkeeping(tiny_qwen, monkeypatch):
    api = SimulatedGraphs()
    g = _graphs(tiny_model(tiny_qwen), max_context=300, api=api)
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPH_KEYS", 8 * 304)
    summary = g.capture()
    captured = [(b, k) for b in (32, 16, 8, 4, 2, 1) for k in (304, 256) if b * k <= 8 * 304]
    assert list(g.graphs) == captured and len(api.captured) == len(captured)   # largest first
    assert g.skipped == [(b, k) for b in (32, 16) for k in (304, 256)]
    assert g.key_buckets == (256, 304)
    assert summary.startswith(f"captured {len(captured)} decode graphs (batch 1,2,4,8,16,32 x keys 256,304)")
    assert "not captured (past 2432 gathered keys, run eagerly): 16x256, 16x304, 32x256, 32x304" in summary
    # steps past the captured buckets run eagerly, and say why
    tables = random_tables(random.Random(0), 16, 2, 40)
    assert g.why_eager(make_batch([([1], 5, t) for t in tables])) == "context past the captured key buckets"


def test_replay_selection_and_eager_fallbacks(tiny_qwen):
    api = SimulatedGraphs()
    g = _graphs(tiny_model(tiny_qwen), pages=60, max_context=300, api=api)
    rng = random.Random(1)
    assert g.run(make_batch([([1], 3, [1])])) is None and g.eager_steps == {"no graphs captured": 1}
    g.capture()
    tables = random_tables(rng, 33, 1, 60)
    long = random_tables(rng, 3, 19, 60)
    cases = [
        (make_batch([([1], 3, t) for t in tables[:3]]), (4, 256)),
        (make_batch([([1], 3, tables[0])]), (1, 256)),
        (make_batch([([1], 3, t) for t in tables[:32]]), (32, 256)),
        (make_batch([([1], 256, long[0]), ([2], 3, long[1])]), (2, 304)),    # 257 keys
        (make_batch([([1, 2, 3], 0, tables[0])]), "prefill or mixed step"),
        (make_batch([([1, 2], 0, tables[0]), ([4], 7, tables[1])]), "prefill or mixed step"),
        (make_batch([([1], 3, tables[0])], rowwise=True), "speculative verify"),
        (make_batch([([1], 3, t) for t in tables]), "more than 32 sequences"),
        (make_batch([([1], 3, tables[0])], with_pages=False), "no block tables"),
    ]
    for batch, expect in cases:
        result = g.run(batch)
        if isinstance(expect, str):
            assert result is None and g.eager_steps[expect] >= 1, expect
        else:
            assert result is not None and result.logits.shape[0] == len(batch.seqs)
            assert g.replays[expect] == 1, (expect, g.replays)
    assert api.replayed == sum(g.replays.values()) == 4


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_replayed_steps_match_the_eager_forward(tiny_model_path, arch):
    """Prefill eagerly, then decode 3 sequences (bucket 4: one padded row) through the graph
    runner and, on a second KV store, eagerly: same logits, same greedy ids; K/V written only
    to the batch's own slots and the scratch slot. gemma3 has sliding-window layers."""
    model = tiny_model(tiny_model_path(arch, context_length=512, sliding_window=32))
    pages = 40
    g = _graphs(model, pages=pages, max_context=300)
    g.capture()
    eager_kv = model.new_kv_store(pages * PAGE + 1)
    tables = random_tables(random.Random(5), 3, 6, pages)
    prompts = [list(range(5, 45)), list(range(9, 79)), [3, 4]]
    prefill = make_batch([(p, 0, t) for p, t in zip(prompts, tables)])
    with torch.inference_mode():
        tokens = model(prefill, g.kv).argmax(-1).tolist()
        model(prefill, eager_kv)
    lengths = [len(p) for p in prompts]
    for step in range(6):
        batch = make_batch([([tok], n, t) for tok, n, t in zip(tokens, lengths, tables)])
        before = [k.clone() for k in g.kv.k]
        result = g.run(batch)
        with torch.inference_mode():
            eager = model(batch, eager_kv)
        torch.testing.assert_close(result.logits, eager, rtol=1e-4, atol=1e-4)
        assert result.logits.argmax(-1).tolist() == eager.argmax(-1).tolist()
        assert result.picked[:, 0].long().tolist() == eager.argmax(-1).tolist()
        changed = {int(s) for k, b in zip(g.kv.k, before) for s in (k != b).any(-1).any(-1).nonzero().flatten()}
        assert changed <= set(batch.write_slots.tolist()) | {g.scratch_slot}
        tokens = eager.argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]
    for k_graph, k_eager in zip(g.kv.k, eager_kv.k):   # the pool's slots alike
        torch.testing.assert_close(k_graph[:g.scratch_slot], k_eager[:g.scratch_slot], rtol=1e-4, atol=1e-5)
    assert sum(g.replays.values()) == 6


def test_a_subset_of_logits_rows_is_picked_from_the_static_output(tiny_qwen):
    g = _graphs(tiny_model(tiny_qwen))
    g.capture()
    tables = [[1], [2], [3]]
    batch = make_batch([([7], 2, t) for t in tables])
    full = g.run(batch).logits.clone()
    batch.logits_rows = torch.tensor([0, 2])
    # the same inputs again: the K/V rewritten with the same values, the same logits
    part = g.run(batch)
    torch.testing.assert_close(part.logits, full[[0, 2]])
    assert part.picked.shape == (2, 3)


# --- the worker with graphs (simulated graph API on a CPU worker) -------------------------

def _generate(engine, prompts, n=12):
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    handles = [engine.submit(prompt_ids=p, params=params) for p in prompts]
    return [h.result(120).token_ids for h in handles]


def test_a_worker_replays_decode_steps_and_prefills_eagerly(tiny_model_path, monkeypatch):
    """The whole path through a worker: the start-up stage, the capture after the KV store,
    the scratch slot, replays for decode steps and eager prefills, the log line. The graph
    API is SimulatedGraphs on a CPU worker whose linears are dense fp32 torch (as on CUDA)."""
    from engine import kernels
    from engine.facade.engine import Engine
    from engine.worker import runner

    path = str(tiny_model_path("qwen2"))
    prompts = [[5, 9, 12, 40, 7], [7, 3, 3, 100, 2, 8, 1], [44, 45]]
    monkeypatch.setattr(kernels, "available", lambda: False)
    cfg = WorkerConfig(model=path, activation_dtype="fp32", calibrate=False)
    with Engine(EngineConfig(workers=(cfg,), worker_mode="thread")).start(timeout=120) as engine:
        eager = _generate(engine, prompts)

    runners = []
    real_init = runner.ModelRunner.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        runners.append(self)
    monkeypatch.setattr(runner.ModelRunner, "__init__", init)
    monkeypatch.setattr(runner, "wants_cuda_graphs", lambda device, cfg: cfg.cuda_graphs == "on")
    monkeypatch.setattr(runner, "TorchCudaGraphs", SimulatedGraphs)
    with Engine(EngineConfig(workers=(cfg,), worker_mode="thread")).start(timeout=120) as engine:
        replayed = _generate(engine, prompts)
        log = [line.text for line in engine.snapshot().log]
    assert replayed == eager
    graphs = runners[0].graphs
    assert graphs.scratch_slot == runners[0].kv.num_slots - 1
    assert sum(graphs.replays.values()) >= 11 and graphs.eager_steps["prefill or mixed step"] >= 1
    ready = next(line for line in log if "ready:" in line)
    assert "captured 6 decode graphs (batch 1,2,4,8,16,32 x keys 256)" in ready


# --- the setting on CPU workers and without a GPU ------------------------------------------

def test_cpu_worker_accepts_and_ignores_the_setting(tiny_model_path):
    from engine.worker.runner import ModelRunner

    path = str(tiny_model_path("qwen2"))
    quiet = ModelRunner(WorkerConfig(model=path), path)
    asked = ModelRunner(WorkerConfig(model=path, cuda_graphs="on", cuda_graphs_asked=True), path)
    assert not quiet.wants_cuda_graphs and not asked.wants_cuda_graphs
    assert quiet.info["cuda_graphs"] == ""
    assert asked.info["cuda_graphs"] == "`cuda_graphs` ignored: a CPU worker runs no CUDA graphs"
    quiet.allocate_kv(64)
    assert quiet.kv.num_slots == 64 and quiet.scratch_slot is None   # no scratch slot on the CPU


def test_a_capture_that_fails_leaves_the_worker_eager(tiny_model_path):
    from engine.worker.runner import ModelRunner

    class RefusingGraphs(SimulatedGraphs):
        """SIMULATES a driver that refuses to capture."""

        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    path = str(tiny_model_path("qwen2"))
    r = ModelRunner(WorkerConfig(model=path), path)
    r.wants_cuda_graphs = True
    r.allocate_kv(64)
    line = r.capture_cuda_graphs(PAGE, 256, api=RefusingGraphs())
    assert line == ("capture failed (RuntimeError: operation not permitted when stream is capturing): "
                    "every step runs eagerly")
    assert r.graphs is None and r.info["cuda_graphs"] == line


def test_ready_line_says_a_cpu_worker_ignores_the_flag(tiny_model_path):
    from engine.facade.engine import Engine

    cfg = WorkerConfig(model=str(tiny_model_path("qwen2")), cuda_graphs="off", cuda_graphs_asked=True,
                       calibrate=False)
    with Engine(EngineConfig(workers=(cfg,), worker_mode="thread")).start(timeout=120) as engine:
        ready = [line.text for line in engine.snapshot().log if "ready:" in line.text]
    assert len(ready) == 1 and ready[0].endswith("; `cuda_graphs` ignored: a CPU worker runs no CUDA graphs")


def test_cuda_graphs_flag(capsys):
    from app.cli import build_parser, main, with_worker
    from engine.errors import ConfigError

    args = with_worker(build_parser().parse_args(["bench", "single"]))
    assert args.worker.cuda_graphs == "on" and not args.worker.cuda_graphs_asked
    args = with_worker(build_parser().parse_args(["bench", "single", "--cuda-graphs", "off"]))
    assert args.worker.cuda_graphs == "off" and args.worker.cuda_graphs_asked
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "hi", "--cuda-graphs", "maybe"])
    assert exc.value.code == 2 and "--cuda-graphs" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="`cuda_graphs` must be on or off"):
        WorkerConfig(cuda_graphs="yes").validate()
    if NO_GPU:   # asked for graphs, a CUDA worker without a GPU is still refused, in one line
        assert main(["generate", "hi", "--device", "cuda", "--cuda-graphs", "on", "--model", "/nonexistent.gguf"]) == 2
        assert "no CUDA GPU is visible" in capsys.readouterr().err


def test_two_workers_may_share_one_gpu(monkeypatch):
    """--device cuda:0 --device cuda:0: two workers (own model copy and KV each) on GPU 0."""
    from engine.errors import ConfigError
    from engine.facade.devices import parse_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    workers = parse_devices(["cpu", "cuda:0", "cuda:0"], WorkerConfig())
    assert [(w.device, w.name) for w in workers] == [("cpu", "cpu"), ("cuda:0", "cuda:0"), ("cuda:0", "cuda:0#2")]
    with pytest.raises(ConfigError, match="all 1 GPU"):
        parse_devices(["cuda:0", "cuda"], WorkerConfig())
    with pytest.raises(ConfigError, match="only GPUs 0..0 exist"):
        parse_devices(["cuda:1"], WorkerConfig())


def test_greedy_pick_is_the_samplers_greedy_choice():
    from engine.worker.sampling import RequestSampler, greedy_pick, sample

    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 4
    logits[2, 17] = logits[2, 40] = logits[2].max() + 1     # a tie: the lower id wins
    logits[4, 3] = float("nan")
    picked = greedy_pick(logits)
    # a request that returns logprobs: the CPU's greedy path computes them only then
    samplers = [RequestSampler(SamplingParams(return_logprobs=True)) for _ in range(4)]
    full = sample(logits[:4], samplers)
    assert picked[:4, 0].long().tolist() == full.tokens.tolist() and picked[2, 0] == 17
    torch.testing.assert_close(picked[:4, 1].float(), full.logprobs, rtol=1e-5, atol=1e-6)
    assert picked[:, 2].tolist() == [1, 1, 1, 1, 0]


# --- on a GPU ------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU: real CUDA graphs (tools/gpu_check.sh runs these)")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _compare_greedy(model, graphs, eager_kv, prompts, tables, steps):
    """Teacher-forced on the eager path's ids: per decode step, the graph's greedy ids vs the
    eager ones. Returns (steps compared, differing ids where the eager top-2 gap is a near
    tie, differing ids that are not)."""
    from tests.test_fidelity import NEAR_TIE

    prefill = make_batch([(p, 0, t) for p, t in zip(prompts, tables)])
    with torch.inference_mode():
        tokens = model(prefill, graphs.kv).argmax(-1).tolist()
        model(prefill, eager_kv)
    lengths = [len(p) for p in prompts]
    compared = ties = bad = 0
    for _ in range(steps):
        batch = make_batch([([tok], n, t) for tok, n, t in zip(tokens, lengths, tables)])
        result = graphs.run(batch)
        assert result is not None, graphs.eager_steps
        with torch.inference_mode():
            eager = model(batch, eager_kv).float()
        got = result.picked[:, 0].long().cpu()
        top2 = eager.topk(2, dim=-1).values.cpu()
        want = eager.argmax(-1).cpu()
        for row in range(len(tokens)):
            compared += 1
            if got[row] != want[row]:
                if top2[row, 0] - top2[row, 1] < NEAR_TIE:
                    ties += 1
                else:
                    bad += 1
        tokens = want.tolist()
        lengths = [n + 1 for n in lengths]
    return compared, ties, bad


def _gpu_graphs(model, pages, max_context):
    from engine.worker.cuda_graphs import TorchCudaGraphs

    kv = model.new_kv_store(pages * PAGE + 1)
    graphs = DecodeGraphs(model, kv, PAGE, max_context, pages * PAGE, TorchCudaGraphs(model.device))
    graphs.capture()
    return graphs, model.new_kv_store(pages * PAGE + 1)


@needs_gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_graphs_give_the_eager_greedy_ids_on_a_tiny_model(tiny_model_path, dtype):
    model = tiny_model(tiny_model_path("qwen2", hidden=256, head_dim=64, ffn=512, context_length=512),
                       "cuda:0", DTYPES[dtype])
    graphs, eager_kv = _gpu_graphs(model, pages=120, max_context=512)
    rng = random.Random(2)
    for n in (1, 3, 8, 32):
        tables = random_tables(rng, n, 3, 120)
        prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(2, 20))] for _ in range(n)]
        compared, ties, bad = _compare_greedy(model, graphs, eager_kv, prompts, tables, 16)
        assert bad == 0, f"{bad} of {compared} greedy ids differ beyond a near tie ({dtype}, batch {n})"
        if dtype == "fp32":
            assert ties == 0, f"{ties} of {compared} ids differ at fp32 ({dtype}, batch {n})"


@pytest.fixture
def gpu_real_model() -> Path:
    """The real 0.5B: $TOKENTOP_GPU_MODEL (tools/gpu_check.py sets it to the file it carried
    to the GPU machine), else the catalog's, else skip."""
    from tests.conftest import resolve_real_model

    path = os.environ.get("TOKENTOP_GPU_MODEL")
    return Path(path) if path else resolve_real_model()


@needs_gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_graphs_give_the_eager_greedy_ids_on_the_real_model(gpu_real_model, dtype):
    model = Decoder.from_gguf(load_gguf(gpu_real_model), LinearPolicy(activation_dtype=DTYPES[dtype], device="cuda:0"))
    graphs, eager_kv = _gpu_graphs(model, pages=200, max_context=1024)
    rng = random.Random(4)
    for n in (1, 8):
        tables = random_tables(rng, n, 6, 200)
        prompts = [[rng.randrange(100, 20000) for _ in range(24)] for _ in range(n)]
        compared, ties, bad = _compare_greedy(model, graphs, eager_kv, prompts, tables, 24)
        assert bad == 0, f"{bad} of {compared} greedy ids differ beyond a near tie ({dtype}, batch {n}; {ties} near ties)"


@needs_gpu
def test_gpu_captured_step_makes_no_host_sync(tiny_model_path):
    """Replaying a step synchronizes nothing that torch's sync debug mode sees (it raises on
    a sync); the one sync is reading the picked ids afterwards. (The replay's wait on the
    previous step's input copy is an event that has passed by then: that step's ids were read.)"""
    model = tiny_model(tiny_model_path("qwen2", hidden=256, head_dim=64, ffn=512), "cuda:0", torch.bfloat16)
    graphs, _ = _gpu_graphs(model, pages=40, max_context=256)
    batch = make_batch([([5], 9, [1]), ([6], 3, [2]), ([7], 20, [3, 4])])
    graphs.run(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = graphs.run(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert result is not None and result.picked.cpu()[:, 2].all()


@needs_gpu
def test_gpu_engine_greedy_output_with_and_without_graphs(tiny_model_path):
    from engine.facade.engine import Engine

    path = str(tiny_model_path("qwen2", hidden=256, head_dim=64, ffn=512))
    prompts = [[5, 9, 12, 40, 7], [7, 3, 3, 100, 2, 8, 1], [44, 45], [9] * 30]
    out, logs = {}, {}
    for graphs in ("on", "off"):
        cfg = WorkerConfig(device="cuda:0", name="cuda:0", model=path, activation_dtype="fp32",
                           calibrate=False, cuda_graphs=graphs)
        with Engine(EngineConfig(workers=(cfg,), worker_mode="thread")).start(timeout=300) as engine:
            out[graphs] = _generate(engine, prompts, 24)
            logs[graphs] = [line.text for line in engine.snapshot().log]
    assert out["on"] == out["off"]
    assert any("CUDA graphs: captured 6 decode graphs" in line for line in logs["on"])
    assert any("CUDA graphs: off (--cuda-graphs off)" in line for line in logs["off"])
