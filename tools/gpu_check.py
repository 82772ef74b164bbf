"""One prepared check of the CUDA workers on a real GPU: fidelity, CUDA graphs, benchmarks, routing, NVTX."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import tests.test_fidelity  # noqa: E402,F401 - its conftest caps torch at 2 threads (a shared CI box)

torch.set_num_threads(os.cpu_count() or 1)

USAGE = """\
    python3 tools/gpu_check.py --model /tmp/models/qwen0.5.gguf --out $OUT     # on a GPU machine
    python3 tools/gpu_check.py --tiny --out DIR       # tiny random GGUF models (no real model)
    python3 tools/gpu_check.py --dry-run --out DIR    # every step on the CPU (tiny model): the
                                                      # script itself is checked, no GPU figure

Sections, in this order by default (each one's error is recorded and the next one runs; a
time budget skips what no longer fits):
  env        torch, CUDA, GPU names, package versions, the model file's sha256; without a GPU,
             that CUDA workers are refused in one clean line
  gpu_tests  pytest tests/test_cuda_graphs.py tests/test_gpu_paths.py (the CUDA tests skip
             without a GPU): graphs give the eager path's greedy ids per dtype, tiny and real
             model; a replayed step makes no host sync
  fidelity   greedy ids teacher-forced against the fp32 references of
             tests/data/greedy_reference.json (as tests/test_fidelity.py), in bf16, fp16
             and fp32 activations on the device; verdict per dtype. With --tiny/--dry-run the
             reference is the CPU fp32 path on the same tiny model (labelled so).
  step       one decode step of one sequence (bf16, 128-token context), CUDA graphs on and
             off: host wall time vs the GPU's kernel time and kernel count (torch.profiler)
  graphs     decode tok/s of N = 1, 8, 32 concurrent requests (128 tokens each) through the
             engine, CUDA graphs on vs off, one engine after the other
  single     `tokentop bench single --device DEV --cuda-graphs on|off` (prefill, one stream)
  routing    the three-worker burst `bench routing --device cpu --device DEV --device DEV
             --policies cost --routing-log`: every routing decision, each worker's rates
  cpu_threads  the CPU worker at --threads 1,2,4,8,16: 500-token prefill and one-stream
             decode (as bench single), 8 concurrent requests (as bench batching's N=8)
  nvtx       a short generate on DEV with tracing on; NVTX pushes/pops counted through the
             `nvtx` package and compared with the Chrome trace's scopes; nsys if present
  two_gpus   bench routing over cuda:0 and cuda:1 (only with two GPUs)
Not run unless named: kernels (dense cuBLAS vs torch's int4 kernel per fused linear) and
batching (`bench batching --sizes 1,8,32 --no-sequential`).

The CPU sections need the quantized kernels: their build starts in the background at once
(a fresh machine has none) and the first CPU section waits for it.

Writes OUT/gpu_check.json (everything), OUT/gpu_check.txt (the table), OUT/routing-log.jsonl,
OUT/tokentop-*.json (the NVTX section's Chrome trace) and prints the table last.
"""

SECTIONS = ("env", "gpu_tests", "fidelity", "step", "graphs", "single", "routing", "cpu_threads", "nvtx",
            "two_gpus")
EXTRA_SECTIONS = ("kernels", "batching")
# Rough seconds each section needs on an H200 with the 0.5B: a section starts only if it fits.
ESTIMATE_S = {"env": 5, "gpu_tests": 60, "fidelity": 60, "step": 20, "graphs": 50, "single": 50,
              "routing": 90, "cpu_threads": 70, "nvtx": 20, "two_gpus": 60, "kernels": 20, "batching": 60}
CPU_THREADS = (1, 2, 4, 8, 16)
GRAPH_SIZES = (1, 8, 32)
REFERENCE = ROOT / "tests" / "data" / "greedy_reference.json"
PROMPTS_TINY = 4
NEW_TOKENS = 32


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, epilog=USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF path (default: the catalog's qwen2.5-coder-0.5b)")
    p.add_argument("--model-name", default="qwen2.5-coder-0.5b", help="its key in greedy_reference.json")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--budget", type=float, default=450.0, help="seconds for all sections together")
    p.add_argument("--tiny", action="store_true", help="tiny random GGUF model, reference = CPU fp32")
    p.add_argument("--dry-run", action="store_true", help="--tiny on the CPU: checks the script only")
    p.add_argument("--threads", type=int, default=8, help="CPU threads of the routing bench's CPU worker")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS + EXTRA_SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS + EXTRA_SECTIONS)}")
    args.gpu_device = args.device if torch.device(args.device).type == "cuda" else "cuda:0"
    if not args.dry_run and torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU is visible to torch {torch.__version__}: a dry run on the CPU "
              "instead (tiny model, no GPU figure)", flush=True)
        args.dry_run = True
    if args.dry_run:
        args.tiny, args.device = True, "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(args, out)
    check.run(sections)
    return 0


class Check:
    def __init__(self, args, out: Path):
        self.args = args
        self.out = out
        self.t0 = time.monotonic()
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.results: dict = {"mode": "dry-run (CPU, tiny model: no GPU figure)" if args.dry_run
                              else "tiny random model" if args.tiny else "real model",
                              "device": args.device, "argv": sys.argv, "sections": {}}
        self.rows: list[tuple[str, str, str]] = []   # (section, what, value) for the table
        self.model_path = self._model_path()
        self.cuda = torch.device(args.device).type == "cuda"
        # the benches' cache: profiles of their own, the kernels shared with this process
        from engine import kernels
        cache = self.work / "cache"
        cache.mkdir()
        kernels.cache_dir().mkdir(parents=True, exist_ok=True)
        (cache / "kernels").symlink_to(kernels.cache_dir())
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENTOP_CACHE_DIR": str(cache)}
        # a fresh machine has no kernels: build them while the GPU sections run
        self.kernel_build = subprocess.Popen(
            [sys.executable, "-c", KERNEL_BUILD], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**self.env, "MAX_JOBS": str(os.cpu_count() or 2)})
        self.kernels_state: str | None = None

    # --- driver ------------------------------------------------------------------------
    def run(self, sections: list[str]) -> None:
        for name in sections:
            left = self.args.budget - (time.monotonic() - self.t0)
            if left < ESTIMATE_S.get(name, 30) * (0.25 if self.args.dry_run else 1.0):
                self._record(name, {"status": "skipped", "reason": f"time budget: {left:.0f} s left"})
                continue
            t = time.monotonic()
            print(f"== {name} ({left:.0f} s of budget left)", flush=True)
            try:
                res = getattr(self, f"sec_{name}")()
                res.setdefault("status", "ok")
            except Exception as exc:  # noqa: BLE001 - a failing section must not stop the others
                res = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc(limit=12)}
                print(res["traceback"], flush=True)
                self.rows.append((name, "ERROR", res["error"][:110]))
            res["seconds"] = round(time.monotonic() - t, 1)
            self._record(name, res)
        if self.kernel_build.poll() is None:    # no CPU section waited for it: done soon, or stopped
            try:
                self.kernel_build.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.kernel_build.kill()
                self.kernel_build.communicate()
        self.results["total_seconds"] = round(time.monotonic() - self.t0, 1)
        self._write()
        print(self.table(), flush=True)    # last: the part of the output a remote call shows

    def _record(self, name: str, res: dict) -> None:
        self.results["sections"][name] = res
        if res.get("status") == "skipped" and not any(r[0] == name for r in self.rows):
            self.rows.append((name, "skipped", res.get("reason", "")))
        self._write()   # after every section: a killed run still leaves what it measured

    def _write(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / "gpu_check.txt").write_text(self.table())

    def table(self) -> str:
        lines = [f"gpu_check: {self.results['mode']} on {self.args.device}, "
                 f"{time.monotonic() - self.t0:.0f} s"]
        width = max([len(w) for _, w, _ in self.rows] + [10])
        for sec, what, value in self.rows:
            lines.append(f"{sec:11} {what:{width}}  {value}")
        return "\n".join(lines) + "\n"

    # --- helpers -----------------------------------------------------------------------
    def _model_path(self) -> Path:
        if self.args.tiny:
            from tests.fixtures.tiny_gguf import write_tiny_model
            # 1024 tokens of context: the benches' 500- and 516-token prompts fit
            return write_tiny_model(self.work / "tiny-qwen2.gguf", "qwen2", n_layers=2, hidden=256,
                                    n_heads=4, n_kv_heads=2, head_dim=64, ffn=512, context_length=1024)
        if self.args.model:
            return Path(self.args.model)
        from engine.models.catalog import resolve_model
        return Path(resolve_model(self.args.model_name))

    def _gpu_name(self) -> str:
        if torch.device(self.args.device).type == "cuda" and torch.cuda.is_available():
            return torch.cuda.get_device_name(torch.device(self.args.device))
        return "the CPU"

    def _bench(self, name: str, argv: list[str], timeout: float) -> dict:
        """Run `tokentop bench ...` as its own process (a hang or crash stays contained)."""
        report = self.work / f"bench-{name}.json"
        cmd = [sys.executable, "-m", "app.cli", "bench", *argv, "--model", str(self.model_path),
               "--out", str(report)]
        if self.args.tiny:
            cmd.append("--quick")
        left = self.args.budget - (time.monotonic() - self.t0)
        print("$", " ".join(cmd), flush=True)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True,
                                  timeout=max(10.0, min(timeout, left)))
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stderr or b"")[-1500:]
            raise RuntimeError(f"timed out after {exc.timeout:.0f} s; stderr tail: "
                               f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}") from None
        if proc.returncode != 0 or not report.is_file():
            raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")
        data = json.loads(report.read_text())
        data["stderr_tail"] = proc.stderr.strip()[-800:]
        return data

    def _kernels(self) -> str:
        """Wait for the background kernel build (CPU sections need it); what it says."""
        if self.kernels_state is None:
            left = self.args.budget - (time.monotonic() - self.t0)
            try:
                out, _ = self.kernel_build.communicate(timeout=max(30.0, left))
            except subprocess.TimeoutExpired:
                self.kernel_build.kill()
                out = "the build did not finish within the budget"
            tail = (out or "").strip().splitlines()[-1:] or ["no output"]
            ok = self.kernel_build.returncode == 0
            self.kernels_state = ("kernels: " if ok else "kernels unavailable (torch fallback): ") + tail[0][:150]
            self.results["cpu_kernels"] = self.kernels_state
            self.rows.append(("env", "CPU kernels", self.kernels_state))
        return self.kernels_state

    def _cuda_devices(self, specs: list[str]) -> str:
        """Without a GPU: the error a CUDA device spec gets (one line), for the record."""
        from engine.config import WorkerConfig
        from engine.errors import ConfigError
        from engine.facade.devices import parse_devices
        try:
            parse_devices(specs, WorkerConfig())
        except ConfigError as exc:
            return f"refused: {exc}"
        return "NOT refused"

    # --- sections ----------------------------------------------------------------------
    def sec_env(self) -> dict:
        import importlib.metadata as md
        res = {"python": sys.version.split()[0], "torch": torch.__version__,
               "cuda_available": torch.cuda.is_available(), "cuda_version": torch.version.cuda,
               "gpus": [], "model": str(self.model_path), "nsys": shutil.which("nsys")}
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                prop = torch.cuda.get_device_properties(i)
                res["gpus"].append({"index": i, "name": prop.name, "memory_gib": round(prop.total_memory / 2**30, 1),
                                    "capability": f"{prop.major}.{prop.minor}"})
        for pkg in ("numpy", "gguf", "tokenizers", "jinja2", "platformdirs", "nvtx", "textual"):
            try:
                res.setdefault("packages", {})[pkg] = md.version(pkg)
            except md.PackageNotFoundError:
                res.setdefault("packages", {})[pkg] = None
        if not self.args.tiny:
            h = hashlib.sha256()
            with open(self.model_path, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
            res["sha256"] = h.hexdigest()
            want = json.loads(REFERENCE.read_text())["models"].get(self.args.model_name, {}).get("sha256")
            res["sha256_matches_reference"] = res["sha256"] == want
            self.rows.append(("env", "model sha256", "matches the reference" if res["sha256"] == want
                              else f"MISMATCH {res['sha256'][:16]} (fidelity is not comparable)"))
        gpu = ", ".join(g["name"] for g in res["gpus"]) or "none"
        self.rows.append(("env", "torch / GPU", f"{torch.__version__} / {gpu}"))
        if not torch.cuda.is_available():   # every CUDA path refuses cleanly
            dev = self.args.gpu_device
            res["cuda_refused"] = self._cuda_devices(["cpu", dev, dev])
            cli = subprocess.run([sys.executable, "-m", "app.cli", "generate", "hi", "--device", dev,
                                  "--cuda-graphs", "on", "--model", str(self.model_path)],
                                 cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120)
            res["cli_cuda_refused"] = {"exit": cli.returncode, "stderr": cli.stderr.strip()}
            one_line = cli.returncode == 2 and cli.stderr.strip().count("\n") == 0
            self.rows.append(("env", f"--device {dev} without a GPU",
                              f"{'exit 2, one line' if one_line else 'NOT CLEAN: exit ' + str(cli.returncode)}: "
                              f"{cli.stderr.strip()[-90:]}"))
        missing = [k for k, v in res["packages"].items() if v is None]
        if missing:
            self.rows.append(("env", "packages absent", ", ".join(missing)))
        return res

    def sec_fidelity(self) -> dict:
        from tests.test_fidelity import FIRST_LOGITS_ATOL, FP32_FIRST_ATOL, FP32_NEAR_TIE, NEAR_TIE

        if self.args.tiny:
            name, prompts = "tiny-qwen2", self._tiny_reference()
            label = "reference: the CPU fp32 path on the same tiny random model"
        else:
            name = self.args.model_name
            prompts = json.loads(REFERENCE.read_text())["models"][name]["prompts"]
            label = "reference: transformers fp32 on the same GGUF (tests/data/greedy_reference.json)"
        res = {"reference": label, "model": name, "dtypes": {}}
        for dtype in ("bf16", "fp16", "fp32"):
            strict = dtype == "fp32"
            near, atol = (FP32_NEAR_TIE, FP32_FIRST_ATOL) if strict else (NEAR_TIE, FIRST_LOGITS_ATOL)
            try:
                r = fidelity_of(self.model_path, self.args.device, dtype, prompts, near, atol)
            except Exception as exc:  # noqa: BLE001
                r = {"error": f"{type(exc).__name__}: {exc}", "faithful": False}
            res["dtypes"][dtype] = r
            verdict = ("ERROR " + r["error"][:80]) if "error" in r else (
                f"{'faithful' if r['faithful'] else 'NOT FAITHFUL'}: {r['steps'] - r['mismatches']}/"
                f"{r['steps']} steps match, {r['bad']} beyond near-tie, first-logit diff "
                f"{r['first_logit_diff']:.3f}")
            self.rows.append(("fidelity", f"{name} {dtype}", verdict))
        res["unfaithful"] = {d: r.get("error") or r.get("why") for d, r in res["dtypes"].items()
                             if not r.get("faithful")}
        if res["unfaithful"] and not self.args.tiny:
            kind = torch.device(self.args.device).type
            entry = {d: f"greedy output left the fp32 reference on {self._gpu_name()} ({w})"
                     for d, w in res["unfaithful"].items() if d != "fp32"}
            res["refusal_entry"] = {kind: entry}
            self.rows.append(("fidelity", "refuse (engine/facade/devices.py)",
                              f"UNFAITHFUL_ACTIVATION_DTYPES = {json.dumps({kind: entry})[:200]}"))
        if not self.args.tiny:
            res["qwen2.5-coder-1.5b"] = ("not run: the 1.1 GB file cannot travel to the GPU machine "
                                         "(64 MiB per call)")
            self.rows.append(("fidelity", "qwen2.5-coder-1.5b", "not run (file too large to carry)"))
        return res

    def _tiny_reference(self) -> list[dict]:
        """Greedy ids, top-2 gaps and first-step top-8 of the CPU fp32 path (the reference
        format of greedy_reference.json) for a few prompts of the tiny model."""
        from engine.models.decoder import Decoder
        from engine.models.gguf import load_gguf
        from tests.test_fidelity import FP32_DENSE

        model = Decoder.from_gguf(load_gguf(self.model_path), FP32_DENSE)
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        prompts = [{"name": f"p{i}", "prompt_ids": torch.randint(3, vocab, (5 + 3 * i,), generator=g).tolist()}
                   for i in range(PROMPTS_TINY)]
        logits = free_running_greedy(model, [p["prompt_ids"] for p in prompts], NEW_TOKENS)
        for p, lg in zip(prompts, logits):
            top2 = lg.topk(2, dim=-1).values
            first = lg[0].topk(8)
            p.update(greedy_ids=lg.argmax(-1).tolist(), top2_gap=(top2[:, 0] - top2[:, 1]).tolist(),
                     first_topk_ids=first.indices.tolist(), first_topk_logits=first.values.tolist())
        return prompts

    def sec_kernels(self) -> dict:
        res = kernel_choice(self.model_path, self.args.device, quick=self.args.dry_run)
        for op in res["ops"]:
            d, q = op["dense_ms"], op.get("int4_ms")
            cells = " ".join(f"M={m}: {d[str(m)]:.3f}/" + (f"{q[str(m)]:.3f}" if q else "-")
                         for m in res["rows"][:3])
            self.rows.append(("kernels", f"{op['op']} ({op['types']})", f"dense/int4 ms {cells}"))
        for m, t in res["per_token_linears_ms"].items():
            self.rows.append(("kernels", f"all linears M={m}", f"dense {t['dense']:.2f} ms, "
                              f"int4-where-exact {t['int4_where_exact']:.2f} ms, best of both {t['best_of_both']:.2f} ms"))
        if res.get("int4_error"):
            self.rows.append(("kernels", "int4 kernel", "ERROR " + res["int4_error"][:90]))
        return res

    def sec_gpu_tests(self) -> dict:
        """The CUDA tests (they skip without a GPU; a dry run only checks they collect)."""
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "not slow",
               "tests/test_cuda_graphs.py", "tests/test_gpu_paths.py"]
        if not self.cuda:
            cmd += ["-k", "gpu"]
        # without CPU kernels: their build runs in the background, and no test here needs them
        env = {**self.env, "TOKENTOP_KERNELS": "off"}
        if not self.args.tiny:
            env["TOKENTOP_GPU_MODEL"] = str(self.model_path)
        print("$", " ".join(cmd), flush=True)
        left = self.args.budget - (time.monotonic() - self.t0)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(30.0, left))
        lines = proc.stdout.strip().splitlines()
        summary = lines[-1] if lines else proc.stderr.strip()[-200:]
        res = {"command": " ".join(cmd[2:]), "exit": proc.returncode, "summary": summary,
               "failed": [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))],
               "skipped": [ln for ln in lines if ln.startswith("SKIPPED")], "tail": "\n".join(lines[-60:])}
        self.rows.append(("gpu_tests", "pytest", summary.strip("= ")[:110]))
        for line in res["failed"][:6]:
            self.rows.append(("gpu_tests", "failed", line[:110]))
        if proc.returncode not in (0, 5):
            res["status"] = "error"
            res["error"] = f"pytest exit {proc.returncode}: {summary}"
        return res

    def sec_step(self) -> dict:
        res = {}
        for graphs in (False, True):
            key = "graphs_on" if graphs else "graphs_off"
            if graphs and not self.cuda:
                res[key] = {"skipped": "CUDA graphs need a GPU"}
                self.rows.append(("step", "1-seq decode step, graphs on", "skipped: CUDA graphs need a GPU"))
                continue
            r = decode_step_profile(self.model_path, self.args.device, graphs)
            res[key] = r
            gpu = f", GPU kernels {r['gpu_ms']:.2f} ms in {r['kernels']} launches" if r.get("gpu_ms") else ""
            self.rows.append(("step", f"1-seq decode step, graphs {'on' if graphs else 'off'}",
                              f"wall {r['wall_ms']:.2f} ms{gpu}"))
            _free_gpu(self.args.device)
        return res

    def sec_graphs(self) -> dict:
        """Decode through the engine, N concurrent requests, CUDA graphs on, then off."""
        out_tokens = 8 if self.args.dry_run else 128
        res = {"sizes": list(GRAPH_SIZES), "output_tokens": out_tokens, "device": self.args.device}
        if not self.cuda:
            res["note"] = "dry run: a CPU worker ignores --cuda-graphs; both runs are the eager CPU path"
        for mode in ("on", "off"):
            res[mode] = engine_decode_rates(self.model_path, self.args.device, mode, GRAPH_SIZES, out_tokens)
            _free_gpu(self.args.device)
        both = "" if self.cuda else " (CPU dry run: both eager)"
        for n in GRAPH_SIZES:
            on, off = res["on"]["tok_s"][str(n)], res["off"]["tok_s"][str(n)]
            self.rows.append(("graphs", f"N={n} decode on/off", f"{on:.0f} / {off:.0f} tok/s ({on / off:.2f}x){both}"))
        for line in res["on"]["graphs_log"][:1]:
            self.rows.append(("graphs", "log", line[-110:]))
        return res

    def sec_single(self) -> dict:
        self._kernels()   # bench single's helper times the CPU kernels: not while they build
        res = {}
        for mode in ("on", "off"):
            data = self._bench(f"single-graphs-{mode}", ["single", "--device", self.args.device, "--models",
                                                         str(self.model_path), "--runs", "2", "--cuda-graphs", mode], 150)
            res[f"graphs_{mode}"] = data
            for r in data["results"]:
                if "error" in r:
                    self.rows.append(("single", f"graphs {mode} error", r["error"][:100]))
                    continue
                self.rows.append(("single", f"graphs {mode} prefill (500 tok)", f"{r['prefill_tok_s_median']:.0f} tok/s"))
                self.rows.append(("single", f"graphs {mode} decode 1 stream",
                                  f"{r['decode_tok_s_median']:.1f} tok/s (goal >= 150 on a GPU)"))
        return res

    def sec_batching(self) -> dict:
        data = self._bench("batching", ["batching", "--device", self.args.device, "--sizes", "1,8,32",
                                        "--no-sequential", "--runs", "1"], 240)
        for row in data["batching"]:
            self.rows.append(("batching", f"N={row['n']} aggregate", f"{row['batched_tok_s']:.0f} tok/s"))
        big = max(r["n"] for r in data["batching"])
        self.rows.append(("batching", f"N={big} / N=1", f"{data[f'aggregate_n{big}_over_n1']:.2f}x (goal >= 10x)"))
        for k in data["paged_vs_contiguous"]:
            self.rows.append(("batching", f"paged/contig N={k['n']}", f"{k['paged_over_contiguous']:.3f}"))
        return data

    def sec_routing(self) -> dict:
        """The three-worker burst behind the cost router: a CPU worker and two on one GPU."""
        self._kernels()
        log = self.out / "routing-log.jsonl"
        log.unlink(missing_ok=True)
        dev = self.args.device
        devices = ["cpu", dev, dev] if self.cuda else ["cpu", "sim:gpu0", "sim:gpu1"]
        data = self._bench("routing", ["routing", *[a for d in devices for a in ("--device", d)], "--runs", "1",
                                       "--threads", str(self.args.threads), "--policies", "cost",
                                       "--recalibrate", "--routing-log", str(log)], 300)
        if not self.cuda:
            data["note_dry_run"] = ("dry run: two simulated GPU workers stand in for --device cuda:0 twice, which "
                                    f"is {self._cuda_devices(['cpu', self.args.gpu_device, self.args.gpu_device])}")
        decisions = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
        data["routing_log"] = {"file": log.name, "decisions": len(decisions),
                               "first": decisions[:2]}
        self.rows.append(("routing", "routing log", f"{len(decisions)} decisions in {log.name}"))
        return self._routing_rows("routing", data)

    def sec_two_gpus(self) -> dict:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < 2:
            self.rows.append(("two_gpus", "skipped", f"{n} GPU(s) on this machine"))
            return {"status": "skipped", "reason": f"{n} GPU(s) on this machine"}
        data = self._bench("two_gpus", ["routing", "--device", "cuda:0", "--device", "cuda:1", "--runs", "1",
                                        "--policies", "forced-fastest,cost,round-robin", "--recalibrate"], 240)
        return self._routing_rows("two_gpus", data)

    def _routing_rows(self, sec: str, data: dict) -> dict:
        for d in data["devices"]:
            self.rows.append((sec, f"worker {d['name']}", f"profile {d['profile_prefill_tps']:.0f}/"
                              f"{d['profile_decode_tps']:.1f} tok/s prefill/decode"
                              + (" (simulated)" if d["simulated"] else "")))
        for t in data["table"]:
            self.rows.append((sec, f"{t['requests']} req {t['policy']}",
                              f"{t['completion_s']:.2f} s, {t['throughput_tok_s']:.0f} tok/s, "
                              f"requests per worker {t['requests_per_worker']}"))
        return data

    def sec_cpu_threads(self) -> dict:
        """The CPU worker at each thread count: prefill and one stream as bench single measures
        them, 8 concurrent requests as bench batching's N=8 (its timed_burst)."""
        kernels = self._kernels()
        threads = (1, 2) if self.args.dry_run else CPU_THREADS
        prompt, one, eight = (64, 8, 8) if self.args.dry_run else (500, 128, 64)
        res = {"kernels": kernels, "prompt_tokens": prompt, "decode_tokens": one, "n8_tokens_each": eight,
               "threads": {}}
        for t in threads:
            r = cpu_rates(self.model_path, t, prompt, one, eight)
            res["threads"][str(t)] = r
            self.rows.append(("cpu_threads", f"--threads {t}",
                              f"prefill {r['prefill_tok_s']:.0f}, decode {r['decode_tok_s']:.1f}, "
                              f"N=8 {r['n8_tok_s']:.0f} tok/s"))
        return res

    def sec_nvtx(self) -> dict:
        res = nvtx_balance(self.model_path, self.args.device, self.out, force=self.args.dry_run)
        self.rows.append(("nvtx", "pushes / pops", f"{res['pushes']} / {res['pops']}, min depth "
                          f"{res['min_depth']}, backend {res['backend']}"))
        self.rows.append(("nvtx", "vs Chrome trace", "same scopes, same nesting" if res["matches_trace"]
                          else f"DIFFER: {res['difference'][:90]}"))
        if res.get("nsys"):
            self.rows.append(("nvtx", "nsys", res["nsys"][:100]))
        return res


# --- fidelity ------------------------------------------------------------------------------

def free_running_greedy(model, prompts: list[list[int]], n_new: int) -> list[torch.Tensor]:
    """Greedy decoding of all prompts together; returns each prompt's [n_new, vocab] logits
    (the logits that chose each new token), on the CPU as fp32."""
    from tests.test_fidelity import flat_batch, paged_slots

    slots = paged_slots(len(prompts), max(len(p) for p in prompts) + n_new)
    kv = model.new_kv_store(sum(len(s) for s in slots))
    logits = model(flat_batch([(p, 0, i) for i, p in enumerate(prompts)], slots), kv).float().cpu()
    steps = [logits]
    for t in range(n_new - 1):
        nxt = steps[-1].argmax(-1).tolist()
        chunks = [([tok], len(p) + t, i) for i, (p, tok) in enumerate(zip(prompts, nxt))]
        steps.append(model(flat_batch(chunks, slots), kv).float().cpu())
    per = torch.stack(steps, dim=1)
    return [per[i] for i in range(len(prompts))]


def fidelity_of(model_path: Path, device: str, dtype: str, prompts: list[dict],
                near_tie: float, first_atol: float) -> dict:
    """Teacher-forced greedy check of one activation dtype on one device (as test_fidelity)."""
    from engine.models.decoder import Decoder
    from engine.models.gguf import load_gguf
    from engine.models.quant import LinearPolicy
    from tests.test_fidelity import run_greedy

    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    t = time.monotonic()
    # fp32 means exact dense fp32 (on a CPU dry run too, where the GGUF kernels would
    # otherwise quantize activations to int8)
    policy = LinearPolicy(activation_dtype=table[dtype], device=device, use_kernels=dtype != "fp32")
    model = Decoder.from_gguf(load_gguf(model_path), policy)
    load_s = time.monotonic() - t
    t = time.monotonic()
    outcomes = run_greedy(model, prompts, prefill_steps=24)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    run_s = time.monotonic() - t
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    steps = mismatches = bad = 0
    first = 0.0
    notes = []
    for ref, got in zip(prompts, outcomes):
        diffs = [abs(a - b) for a, b in zip(got.first_logits, ref["first_topk_logits"])]
        first = max([first, *diffs]) if all(d == d for d in diffs) else float("inf")   # NaN -> inf
        for step, (ours, want) in enumerate(zip(got.argmax, ref["greedy_ids"])):
            steps += 1
            if ours != want:
                mismatches += 1
                gap = ref["top2_gap"][step]
                bad += gap >= near_tie
                notes.append({"prompt": ref["name"], "step": step, "ours": ours, "reference": want,
                              "reference_top2_gap": round(gap, 4), "near_tie": gap < near_tie})
    faithful = bad == 0 and first < first_atol
    why = None if faithful else (f"{bad} greedy step(s) left the fp32 reference where it was not a "
                                 f"near-tie (< {near_tie} logits)" if bad else
                                 f"first-step logits differ from the fp32 reference by {first:.3f}")
    return {"faithful": faithful, "why": why, "steps": steps, "mismatches": mismatches, "bad": bad,
            "first_logit_diff": first, "near_tie": near_tie, "first_atol": first_atol,
            "divergences": notes[:40], "load_s": round(load_s, 1), "run_s": round(run_s, 2)}


# --- one decode step ------------------------------------------------------------------------

def decode_step_profile(model_path: Path, device: str, graphs: bool, context: int = 128, steps: int = 20) -> dict:
    """Wall time of one-sequence decode steps (eager, or replaying CUDA graphs), and (on a GPU)
    the kernels' own time per step."""
    from engine.models.batch import ForwardBatch, SeqSlice
    from engine.models.decoder import Decoder
    from engine.models.gguf import load_gguf
    from engine.models.quant import LinearPolicy

    page = 16
    model = Decoder.from_gguf(load_gguf(model_path), LinearPolicy(activation_dtype=torch.bfloat16, device=device))
    pages = list(range(-(-(context + 2 * steps + 8) // page)))
    slots = (torch.tensor(pages)[:, None] * page + torch.arange(page)).reshape(-1)
    scratch = len(pages) * page
    kv = model.new_kv_store(scratch + 1)     # + the graphs' scratch slot
    res = {"context": context, "steps": steps, "cuda_graphs": graphs}
    runner = None
    if graphs:
        from engine.worker.cuda_graphs import DecodeGraphs, TorchCudaGraphs
        runner = DecodeGraphs(model, kv, page, scratch, scratch, TorchCudaGraphs(torch.device(device)))
        res["captured"] = runner.capture()

    def batch(ids: list[int], first: int) -> ForwardBatch:
        ctx = first + len(ids)
        return ForwardBatch(torch.tensor(ids), torch.arange(first, ctx), slots[first:ctx],
                            [SeqSlice(0, len(ids), ctx, slots[:ctx], pages=pages)], torch.tensor([len(ids) - 1]))

    ids = torch.randint(3, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        model(batch(ids, 0), kv)
    pos = context

    def step() -> int:
        nonlocal pos
        b = batch([ids[pos % context]], pos)
        pos += 1
        if runner is not None:
            return int(runner.run(b).picked[0, 0])     # the one host read of a step
        with torch.inference_mode():
            return int(model(b, kv).argmax())            # the engine samples on the host every step too

    for _ in range(3):
        step()
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    res["wall_ms"] = (time.perf_counter() - t) * 1e3 / steps
    if torch.device(device).type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            _sync(device)
        gpu_us, kernels = 0.0, 0
        for evt in prof.events():
            if str(getattr(evt, "device_type", "")).endswith("CUDA"):
                gpu_us += evt.time_range.elapsed_us()     # a kernel's (or copy's) own span
                kernels += 1
        res.update(gpu_ms=gpu_us / 1e3 / 5, kernels=kernels // 5,
                   note="kernels: the GPU events torch.profiler saw per step (a replayed graph's "
                        "kernels as it reports them)")
    if runner is not None:
        res["replays"] = sum(runner.replays.values())
    return res


def engine_decode_rates(model_path: Path, device: str, graphs: str, sizes: tuple[int, ...], out_tokens: int) -> dict:
    """Aggregate decode tok/s of n concurrent requests through one engine (bench batching's
    timed_burst), for each n; and the log lines on CUDA graphs."""
    from engine.bench.common import start_engine, stop_engine, timed_burst
    from engine.config import WorkerConfig
    from engine.facade.devices import parse_devices

    base = WorkerConfig(model=str(model_path), max_active=max(sizes), calibrate=False,
                        cuda_graphs=graphs, cuda_graphs_asked=True)
    t = time.monotonic()
    engine = start_engine(parse_devices([device], base))
    try:
        started = time.monotonic() - t
        timed_burst(engine, 2, 8, True, "warm")
        timed_burst(engine, 1, 8, True, "warm")
        rates = {str(n): n * out_tokens / timed_burst(engine, n, out_tokens, True, f"graphs {graphs} {n}")
                 for n in sizes}
        log = [line.text for line in engine.snapshot().log]
    finally:
        stop_engine(engine)
    return {"tok_s": rates, "engine_start_s": round(started, 1),
            "graphs_log": [line for line in log if "CUDA graphs" in line or "cuda-graphs" in line]}


def cpu_rates(model_path: Path, threads: int, prompt_tokens: int, decode_tokens: int, n8_tokens: int) -> dict:
    """One CPU worker (its own process) at `threads`: prefill and one-stream decode as bench
    single measures them (ttft of a long prompt; the tokens after the first over their time),
    and 8 concurrent requests as bench batching's N=8."""
    from engine.bench.common import prompt_of, start_engine, stop_engine, timed_burst
    from engine.config import SamplingParams, WorkerConfig
    from engine.facade.devices import parse_devices

    base = WorkerConfig(model=str(model_path), threads=threads, max_active=8, calibrate=False)
    engine = start_engine(parse_devices(["cpu"], base), mode="process")
    try:
        engine.generate(prompt_ids=prompt_of(engine, 64, "warm up "), params=SamplingParams(max_tokens=8, ignore_eos=True))
        r = engine.generate(prompt_ids=prompt_of(engine, prompt_tokens, f"threads {threads}: "),
                            params=SamplingParams(max_tokens=1))
        prefill = prompt_tokens / r.metrics.ttft
        m = engine.generate(prompt_ids=prompt_of(engine, 16, f"decode {threads}: "),
                            params=SamplingParams(max_tokens=decode_tokens, ignore_eos=True)).metrics
        decode = (m.output_tokens - 1) / (m.e2e - m.ttft)
        n8 = 8 * n8_tokens / timed_burst(engine, 8, n8_tokens, True, f"threads {threads}")
        kernels = engine.snapshot().workers[0].kernels
    finally:
        stop_engine(engine)
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "n8_tok_s": n8, "linear_layers": kernels}


def _free_gpu(device: str) -> None:
    import gc
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


KERNEL_BUILD = """
import sys, time
t = time.perf_counter()
from engine import kernels
ok = kernels.load()
print(f"{kernels.describe()} (ready after {time.perf_counter() - t:.0f} s)" if ok else kernels.status()["reason"])
sys.exit(0 if ok else 3)
"""


# --- kernel choice --------------------------------------------------------------------------

def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: str, reps: int) -> float:
    """Median ms per call (CUDA events on a GPU), after a warm-up."""
    for _ in range(3):
        fn()
    _sync(device)
    times = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2]


class Int4Kernel:
    """torch's int4 matmul on exact nibble planes: CUDA's tinygemm, or the CPU kernel in a
    dry run. Both compute w = (q - 8) * scale + zero per 32-group along K."""

    def __init__(self, device: str):
        self.device = device
        self.cuda = torch.device(device).type == "cuda"
        self.inner_k_tiles = 8
        self.high_first = True      # even column in the high nibble; flipped if results say so

    def pack(self, q: torch.Tensor) -> torch.Tensor:
        """q: uint8 codes 0..15 [N, K] (CPU) -> the kernel's packed weight on the device."""
        if not self.cuda:
            return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # [N, K/2] bytes, even column in the high nibble (the layout torch's own tests pack)
        hi, lo = (q[:, ::2], q[:, 1::2]) if self.high_first else (q[:, 1::2], q[:, ::2])
        packed = ((hi << 4) | lo).to(torch.uint8).to(self.device)
        last = None
        for tiles in (self.inner_k_tiles, 4, 2):
            if q.shape[1] % (tiles * 16):
                continue
            try:
                return torch.ops.aten._convert_weight_to_int4pack(packed, tiles)
            except RuntimeError as exc:
                last = exc
        raise RuntimeError(f"no inner_k_tiles fits K={q.shape[1]}: {last}")

    def mm(self, x: torch.Tensor, w: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            return torch.ops.aten._weight_int4pack_mm(x, w, 32, scales_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 32, scales_zeros)


def _fused_ops(gf) -> list[tuple[str, list[str], int]]:
    """(label, tensor names, how many layers it stands for): each fused linear of the decoder,
    once per distinct mix of GGUF types (Q4_K_M varies them by layer), plus the lm_head."""
    c = gf.config
    kinds = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
             "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}
    ops = []
    for kind, parts in kinds.items():
        groups: dict[tuple, list[int]] = {}
        for layer in range(c.n_layers):
            names = tuple(f"blk.{layer}.{p}.weight" for p in parts)
            groups.setdefault(tuple(gf.tensor(n).ggml_type for n in names), []).append(layer)
        for layers in groups.values():
            names = [f"blk.{layers[0]}.{p}.weight" for p in parts]
            ops.append((f"{kind} x{len(layers)}", names, len(layers)))
    head = "token_embd.weight" if c.tied_embeddings else "output.weight"
    return ops + [("lm_head", [head], 1)]


def kernel_choice(model_path: Path, device: str, quick: bool = False) -> dict:
    """Dense (cuBLAS on a GPU) vs torch's int4 kernel on the model's own fused linears."""
    import numpy as np

    from engine.models.gguf import load_gguf
    from engine.models.quant import _unpack, dequantize

    gf = load_gguf(model_path)
    kernel = Int4Kernel(device)
    rows = [1, 8, 32] if quick else [1, 8, 32, 256]
    reps = 5 if quick else 50
    dtype = torch.bfloat16
    res = {"rows": rows, "dtype": "bf16", "ops": [], "int4_error": None,
           "note": "int4 = torch's _weight_int4pack_mm on exact nibble planes (scales rounded to bf16); "
                   "types it cannot hold exactly (Q6_K's 16-groups, floats) count as dense"}
    totals = {str(m): {"dense": 0.0, "int4_where_exact": 0.0, "best_of_both": 0.0} for m in rows}
    g = torch.Generator().manual_seed(0)
    for label, names, count in _fused_ops(gf):
        tds = [gf.tensor(n) for n in names]
        k = tds[0].shape[1]
        w32 = torch.cat([dequantize(t) for t in tds])                      # exact GGUF values, fp32
        n = w32.shape[0]
        dense = w32.to(dtype).to(device)
        op = {"op": label, "types": "+".join(sorted({t.ggml_type.name for t in tds})), "n": n, "k": k,
              "layers": count, "dense_ms": {}, "int4_ms": None}
        x32 = torch.randn(max(rows), k, generator=g)
        ref = x32[:32].double() @ w32.double().T    # error measured on the first 32 rows
        exact = all(t.ggml_type in INT4_EXACT_TYPES for t in tds) and k % 32 == 0
        q4 = None
        for attempt in range(2 if exact else 0):   # a second try flips the nibble order
            try:
                codes = [_int4_planes(_unpack(t), dtype) for t in tds]
                planes = max(c[0].shape[1] // k for c in codes)
                q, s, z = (np.concatenate(list(parts)) for parts in zip(*[_widen_part(c, k, planes) for c in codes]))
                pad = -n % 32     # both kernels tile N: zero-weight rows (q = 8, s = z = 0) fill it
                if pad:
                    q = np.concatenate([q, np.full((pad, q.shape[1]), 8, np.uint8)])
                    s, z = (np.concatenate([a, np.zeros((pad, a.shape[1]), np.float32)]) for a in (s, z))
                packed = kernel.pack(torch.from_numpy(np.ascontiguousarray(q)))
                sz = torch.from_numpy(np.stack([s.T, z.T], axis=-1).copy()).to(dtype).to(device)
                xr = x32[:32].to(dtype).to(device)
                xr = xr.repeat(1, planes) if planes > 1 else xr.contiguous()
                y4 = kernel.mm(xr, packed, sz)[:, :n].double().cpu()
                op["int4_rel_err"] = float((y4 - ref).norm() / ref.norm())
                if not op["int4_rel_err"] < 2e-2:    # a wrong layout gives O(1) errors
                    raise RuntimeError(f"int4 result is off by {op['int4_rel_err']:.3g} relative "
                                       f"(nibble order {'high' if kernel.high_first else 'low'}-first)")
                q4 = (packed, sz, planes)
                op["planes"], op["int4_ms"] = planes, {}
                res["nibble_order"] = "even column in the high nibble" if kernel.high_first else "even column in the low nibble"
                break
            except Exception as exc:  # noqa: BLE001 - record, keep the dense figures
                q4 = None
                if attempt == 0 and "off by" in str(exc):
                    kernel.high_first = not kernel.high_first
                    continue
                res["int4_error"] = res["int4_error"] or f"{label}: {type(exc).__name__}: {exc}"
                break
        x_dev = x32.to(dtype).to(device)
        y = torch.nn.functional.linear(x_dev[:32], dense).double().cpu()
        op["dense_rel_err"] = float((y - ref).norm() / ref.norm())
        for m in rows:
            xm = x_dev[:m].contiguous()
            op["dense_ms"][str(m)] = time_ms(lambda: torch.nn.functional.linear(xm, dense), device, reps)
            totals[str(m)]["dense"] += op["dense_ms"][str(m)] * count
            int4 = op["dense_ms"][str(m)]
            if q4 is not None:
                packed, sz, planes = q4
                xq = xm.repeat(1, planes) if planes > 1 else xm
                op["int4_ms"][str(m)] = int4 = time_ms(lambda: kernel.mm(xq, packed, sz), device, reps)
            totals[str(m)]["int4_where_exact"] += int4 * count
            totals[str(m)]["best_of_both"] += min(int4, op["dense_ms"][str(m)]) * count
        res["ops"].append(op)
        dense = q4 = None   # let the device memory go before the next op
    res["per_token_linears_ms"] = totals
    return res


def _widen_part(part, k: int, planes: int):
    return _widen(part, k, planes)



# --- exact int4 nibble planes (for the CUDA int4 experiment only; the engine reads GGUF blocks
# through engine/kernels on the CPU and keeps dense weights on CUDA) --------------------------

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as _T  # noqa: E402

from engine.errors import ModelError  # noqa: E402
from engine.models.quant import _Codes  # noqa: E402

INT4_EXACT_TYPES = (_T.Q4_0, _T.Q4_K, _T.Q5_0, _T.Q5_K, _T.Q8_0)
INT4_GROUP = 32
_Int4Part = tuple


def _round_np(a: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """fp32 values rounded (nearest even) to `dtype`'s precision, still as fp32."""
    if dtype == torch.float32:
        return a
    if dtype == torch.float16:
        return a.astype(np.float16).astype(np.float32)
    if dtype == torch.bfloat16:
        u = a.astype(np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    raise ModelError(f"activation dtype {dtype} is not supported (use bf16, fp16 or fp32)")


def _int4_planes(c: _Codes, dtype: torch.dtype) -> _Int4Part:
    """Exact nibble planes of codes.

    Scales are rounded to `dtype` (the kernel's, e.g. bf16) and zeros are derived from the
    rounded scales, so the only loss is that rounding. Every zero below is the rounded scale
    times a power of two (exact), except K-quants' 8*s - dmin*m, which is rounded once more.
    """
    s = _round_np(c.scale, dtype)
    minus = c.minus if c.minus is not None else np.float32(0)
    if c.bits == 4:
        # w = s*(q - offset) - minus = (q - 8)*s + [(8 - offset)*s - minus]
        return c.q, s, _round_np((8 - c.offset) * s - minus, dtype)
    # q = 16*hi + lo.  hi plane: (hi - 8)*16s + z_hi;  lo plane: (lo - 8)*s + z_lo;
    # constants must add up to -offset*s - minus:  z_hi + z_lo = (136 - offset)*s - minus.
    # Q5_0 (offset 16): z_hi = 128s, z_lo = -8s.  Q8_0 (128): z_hi = 0, z_lo = 8s.
    # Q5_K (0): z_hi = 128s, z_lo = 8s - minus.
    z_hi = 128 * s if c.offset < 128 else np.zeros_like(s)
    z_lo = _round_np((136 - c.offset) * s - z_hi - minus, dtype)
    return (np.concatenate([c.q & 0x0F, c.q >> 4], axis=1),
            np.concatenate([s, 16 * s], axis=1), np.concatenate([z_lo, z_hi], axis=1))


def _widen(part: _Int4Part, k: int, planes: int) -> _Int4Part:
    """Append zero-weight planes (q4 = 8, s = z = 0) so stacked tensors share one plane count."""
    q, s, z = part
    extra = planes * k - q.shape[1]
    if extra == 0:
        return part
    pad = np.zeros((s.shape[0], extra // INT4_GROUP), np.float32)
    return (np.concatenate([q, np.full((q.shape[0], extra), 8, np.uint8)], axis=1),
            np.concatenate([s, pad], axis=1), np.concatenate([z, pad], axis=1))


# --- NVTX -------------------------------------------------------------------------------------

class CountingNvtx:
    """An NVTX backend that forwards to the `nvtx` package (when installed) and records, per
    thread, every push and pop: balance, depth, and the (name, depth) sequence of pushes."""

    def __init__(self):
        self.inner = None
        try:
            from engine.trace import NvtxPackageBackend
            self.inner = NvtxPackageBackend()
        except ImportError:
            pass
        self.lock = threading.Lock()
        self.threads: dict[int, dict] = {}

    def _state(self) -> dict:
        tid = threading.get_native_id()
        st = self.threads.get(tid)
        if st is None:
            with self.lock:
                st = self.threads.setdefault(tid, {"depth": 0, "min_depth": 0, "pushes": 0, "pops": 0,
                                                   "sequence": []})
        return st

    def push_range(self, message: str, color: int) -> None:
        st = self._state()
        words = message.split(" ")      # "name k=v k=v": the name may hold spaces, args don't
        cut = next((i for i, w in enumerate(words) if "=" in w), len(words))
        st["sequence"].append((" ".join(words[:cut]), st["depth"]))
        st["depth"] += 1
        st["pushes"] += 1
        if self.inner is not None:
            self.inner.push_range(message, color)

    def pop_range(self) -> None:
        st = self._state()
        st["depth"] -= 1
        st["pops"] += 1
        st["min_depth"] = min(st["min_depth"], st["depth"])
        if self.inner is not None:
            self.inner.pop_range()


def _trace_sequence(events: list[dict], tid: int) -> list[tuple[str, int]]:
    """The (name, depth) sequence of one track's scopes, in start order."""
    spans = sorted(((round(e["ts"] * 1000), round(e["dur"] * 1000), e["name"]) for e in events
                    if e.get("ph") == "X" and e.get("tid") == tid), key=lambda s: (s[0], -s[1]))
    stack, seq = [], []
    for start, dur, name in spans:
        while stack and stack[-1] <= start:
            stack.pop()
        seq.append((name, len(stack)))
        stack.append(start + dur)
    return seq


def nvtx_balance(model_path: Path, device: str, out: Path, force: bool = False) -> dict:
    """A short generate with tracing on, every NVTX push/pop counted; compared with the trace."""
    import engine.trace as trace
    from tests.trace_checks import check_nesting
    from engine.config import EngineConfig, SamplingParams, WorkerConfig
    from engine.facade.engine import Engine

    backend = CountingNvtx()
    real = trace._make_nvtx_backend
    # Workers on CUDA ask for NVTX; a dry run on the CPU forces it so the same path is checked.
    trace._make_nvtx_backend = lambda nvtx: backend if (nvtx is True or (force and nvtx is False)) else real(nvtx)
    trace_dir = out
    try:
        cfg = WorkerConfig(device=device, model=str(model_path), calibrate=False, name=device)
        engine = Engine(EngineConfig(workers=(cfg,), worker_mode="thread", trace_dir=str(trace_dir))).start()
        try:
            r = engine.generate("The capital of France is", params=SamplingParams(max_tokens=16, ignore_eos=True))
            if r.finish_reason != "length":
                raise RuntimeError(f"generate failed: {r.error}")
            path = engine.export_trace(trace_dir)
        finally:
            engine.shutdown()
    finally:
        trace._make_nvtx_backend = real
    events = json.loads(Path(path).read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    pushes = sum(s["pushes"] for s in backend.threads.values())
    pops = sum(s["pops"] for s in backend.threads.values())
    difference = ""
    for tid, st in backend.threads.items():
        ours, theirs = st["sequence"], _trace_sequence(events, tid)
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            difference = (f"thread {tid}: {len(ours)} NVTX ranges vs {len(theirs)} trace scopes; first "
                          f"difference at #{at}: {ours[at:at + 1]} vs {theirs[at:at + 1]}")
            break
    res = {"backend": "nvtx package" if backend.inner is not None else "counting only (nvtx package absent)",
           "pushes": pushes, "pops": pops, "balanced": pushes == pops and all(s["depth"] == 0 for s in backend.threads.values()),
           "min_depth": min([s["min_depth"] for s in backend.threads.values()] or [0]),
           "threads": {str(t): {k: v for k, v in s.items() if k != "sequence"} for t, s in backend.threads.items()},
           "trace_file": Path(path).name, "trace_nesting_problems": check_nesting(events)[:5],
           "matches_trace": not difference and bool(backend.threads), "difference": difference or
           ("" if backend.threads else "no NVTX range was pushed")}
    if shutil.which("nsys") and torch.device(device).type == "cuda":
        res["nsys"] = _nsys(model_path, device, out)
    else:
        res["nsys"] = None
    return res


def _nsys(model_path: Path, device: str, out: Path) -> str:
    """nsys profile of a short generate, then its NVTX summary (first lines)."""
    rep = Path(tempfile.mkdtemp()) / "gen"
    cmd = ["nsys", "profile", "-t", "nvtx,cuda", "-o", str(rep), sys.executable, "-m", "app.cli", "generate",
           "The capital of France is", "--max-tokens", "16", "--device", device, "--model", str(model_path)]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        s = subprocess.run(["nsys", "stats", "--report", "nvtx_sum", f"{rep}.nsys-rep"], capture_output=True,
                           text=True, timeout=60)
        return f"profile exit {p.returncode}; nvtx_sum: " + " | ".join(s.stdout.strip().splitlines()[:12])
    except Exception as exc:  # noqa: BLE001
        return f"nsys failed: {type(exc).__name__}: {exc}"


if __name__ == "__main__":
    args_ok = main()
    sys.exit(args_ok)
