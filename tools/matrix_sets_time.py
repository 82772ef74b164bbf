"""Median time of three sets of a model's matrices through the op at M activation rows, each
matrix read from the GGUF mapping (from memory: the sets are larger than the caches): the
lm_head, every gate and up matrix, every down matrix; the op's default kernel for M rows.
Prints one line: "lm_head MS gate_up MS down MS" (medians of 11 passes, in ms). For A/B runs
alternate two checkouts under the CPU lock, e.g.
  for r in 1 2 3 4 5 6; do for t in /path/a /path/b; do
    (cd $t && flock /tmp/tokentop-cpu.lock env PYTHONPATH=. python tools/matrix_sets_time.py qwen2.5-coder-0.5b 8)
  done; done
"""
import sys, time, torch, os
sys.path.insert(0, '.')
from engine import kernels
from engine.models.catalog import resolve_model
from engine.models.gguf import load_gguf
kernels.load(); torch.set_num_threads(int(os.environ.get("NT", 2)))
gf = load_gguf(str(resolve_model(sys.argv[1])))
M = int(sys.argv[2])
n_layers = sum(1 for n in gf.tensors if n.endswith("ffn_up.weight"))
def mats(names):
    out = []
    for name in names:
        td = gf.tensor(name); w = torch.from_numpy(td.raw.reshape(td.raw.shape[0], -1))
        out.append((w, int(td.ggml_type), w.shape[0], torch.randn(M, td.shape[-1])))
    return out
sets = {"lm_head": mats(["output.weight"] if gf.has("output.weight") else ["token_embd.weight"]),
        "gate_up": mats([f"blk.{i}.ffn_{p}.weight" for i in range(n_layers) for p in ("gate", "up")]),
        "down": mats([f"blk.{i}.ffn_down.weight" for i in range(n_layers)])}
def run(ms):
    t0 = time.perf_counter()
    for w, t, n, x in ms: kernels.qmatmul(x, [w], [t], [n], None, None, -1, -1)
    return time.perf_counter() - t0
res = {k: [] for k in sets}
for r in range(11):
    for k, ms in sets.items(): res[k].append(run(ms))
print(" ".join(f"{k} {sorted(v)[5]*1000:.2f}" for k, v in res.items()))
