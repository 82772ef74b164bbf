"""GGUF-native quantized matmul: the C++ op `tokentop::qmatmul`, built on first use.

The op computes y = x W^T straight from the GGUF blocks of Q4_0, Q5_0, Q8_0, Q4_K, Q5_K and
Q6_K matrices (the mmap'd file is the weight). It follows llama.cpp's scheme: each activation
row is quantized once to int8 with one scale per 32 values (per 256 against K-quant weights in
the direct kernels, llama.cpp's Q8_K, so a super-block's sum stays in integers), then
integer dot products (AVX-512 VNNI vpdpbusd / vpdpwssd, AVX2 maddubs/madd, or portable C++),
picked at run time from cpuid.
TOKENTOP_KERNEL_ISA=scalar|avx2|avx512 caps the choice (tests force each path).

The library is compiled once per torch version, source hash and CPU into the platformdirs
cache (`nice -n 19`, in a child process, so a failed build cannot take the engine down).
Without a compiler the model falls back to dense torch matmuls, with one log line saying so.

Error bound (what tests/test_kernels.py checks). Row m of x is quantized per group g of 32
values (256 against K-quants in the direct kernels; the bound below holds for either, with
that group's d_g) to
a_i = round(x_i / d_g), d_g = max|x_g| / 127, so x̂_i = d_g a_i and |x_i - x̂_i| <= d_g / 2
(plus at most one rounding of x_i / d_g, |a_i| <= 127: d_g * 2^-17 more). Every weight is
w_i = s * code_i - b with an integer code, so the kernel's integer dot products and per-lane
scales evaluate sum_i w_i x̂_i exactly up to fp32 rounding of the scale products and the sums.
Hence, with eps = 2^-24 and n the number of fp32 additions along K (at most K/16 + 32):
    |y - W x̂| <= n * eps * sum_i (|w_i| + 2 |b_i|) |x̂_i|        (fp32 evaluation)
    |y - W x| <= sum_i |w_i| d_g(i) (1/2 + 2^-17) + the line above (activation rounding)
The first bound is ~1e-5 relative: it pins down every code, scale and offset exactly.
Both kernels meet it: the tiles add K/16 terms per output (scale, then bias, per 16 weights);
the direct decode kernels split each SIMD lane's sum over two chains (even and odd blocks, or
K-quant super-blocks), then add the chains (1) and the lanes (3 for AVX2's 8, 4 for AVX-512's 16).
Per chain and lane that is K/64 additions on AVX2 (one FMA per 32-weight block, every other
block) and K/128 on AVX-512 (one per 64 weights, every other 64); for K-quants one FMA (the
super-block's int32 sum, converted exactly) and one minimum or one / two Q6_K offset terms per
256 weights, every other super-block: at most 3K/512. The coarser K-quant groups make d_g, so the
second bound, larger where a 256-group holds an outlier (up to 8x a 32-group's); llama.cpp
quantizes the same way for these types.

Three kinds of kernel, by the call's row count (which file serves which call size and ISA: the
table atop qkernels.cpp): calls of up to direct_rows() rows (decode, small batches; 4 on AVX2,
1 on AVX-512) take the direct kernels, which go from GGUF block to register with no unpacked copy,
each weight vector dotted against every row of the call; larger calls (batches,
speculative verifies, prefill) take the panel kernel (AVX-512 and AVX2, the same bits):
32 (AVX2: 16) output rows built from the blocks over all of K (on AVX-512 the K-quants read a
copy packed in that form once, packed_bytes()), every activation row run through them with the accumulators in registers, code offsets subtracted inside the integer
dots, scales applied per 32 (per 16 for Q6_K: at most K/16 fp32 additions, within the bound
above). The row kernels (portable, AVX2) and the AVX-512 tiles unpack weight rows first: the
portable path's kernel for every call and, since the kernels' fp32 sums differ in the last
bits, every ISA's for every row count in deterministic mode (small_m=0).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("tokentop.kernels")

_DIR = Path(__file__).parent
# fused_ops.cpp: the per-layer ops around the matmuls (engine/models/fused.py); decode_layers.cpp:
# every layer of a decode step in one call from Python (engine/models/decoder.py); gguf_rows.cpp:
# exact dot products with a few dequantized rows and top_candidates.cpp: each row's largest logits
# (the decoder's refinement of the top logits)
SOURCES = ("qmatmul_op.cpp", "qkernels.cpp", "fused_ops.cpp", "decode_layers.cpp", "gguf_rows.cpp",
           "top_candidates.cpp")
# every header and included kernel file: all of them key the build (a file left out of the key
# would let an edited kernel run its stale build)
DEPENDS = tuple(sorted(p.name for p in _DIR.iterdir() if p.suffix in (".h", ".inc")))
ISA_NAMES = ("scalar", "avx2", "avx512")
# GGML type ids the op reads (gguf.GGMLQuantizationType values)
KERNEL_TYPES = (2, 6, 8, 12, 13, 14)   # Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K
BUILD_TIMEOUT_S = 600

_state: dict = {"available": None, "reason": "", "build_s": None, "library": None}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return ""
    want = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni")
    have = set(line.split())
    return ",".join(f for f in want if f in have)


def _build_key() -> str:
    h = hashlib.sha256()
    for name in SOURCES + DEPENDS:
        h.update(name.encode())
        h.update((_DIR / name).read_bytes())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def build_key() -> str:
    """Names this build of the kernels: their sources, torch, the CPU's flags and Python."""
    return _build_key()


def cache_dir() -> Path:
    import platformdirs

    root = os.environ.get("TOKENTOP_CACHE_DIR") or platformdirs.user_cache_dir("tokentop")
    return Path(root) / "kernels"


_BUILD_SCRIPT = """
import sys, torch.utils.cpp_extension as ce
name, build_dir, *sources = sys.argv[1:]
ce.load(name=name, sources=sources, build_directory=build_dir, is_python_module=False,
        extra_cflags=["-O3", "-std=c++17", "-fopenmp"], extra_ldflags=["-fopenmp"],
        verbose=False)
"""


def _compile(name: str, build_dir: Path, sources: tuple[Path, ...] | None = None,
             timeout: float = BUILD_TIMEOUT_S) -> Path:
    """Build in a child process at the lowest CPU priority; returns the shared library.

    One build at a time per library, under an flock that the OS drops when its holder dies.
    Under it any `lock` file torch's cpp_extension left in build_dir is stale (a build killed
    mid-way, e.g. by the time-out) and is removed: torch waits for that file to vanish, so a
    stale one made every later start wait out the whole time-out and run without kernels."""
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    lib = build_dir / f"{name}.so"
    sources = tuple(_DIR / s for s in SOURCES) if sources is None else sources
    with open(build_dir.parent / f"{name}.build-lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if lib.exists():                       # another process built it while this one waited
            return lib
        (build_dir / "lock").unlink(missing_ok=True)
        env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
        cmd = [sys.executable, "-c", _BUILD_SCRIPT, name, str(build_dir), *map(str, sources)]
        if shutil.which("nice"):
            cmd = ["nice", "-n", "19", *cmd]
        # a session of its own, so a time-out ends ninja and the compilers too, not just python;
        # the child holds the flock too, so a build that outlives this process (its engine quit
        # mid-build) still keeps the next start from removing torch's file under it
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, pass_fds=(held.fileno(),))
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            raise RuntimeError(f"the build took over {timeout:.0f} s (a busy machine?); it resumes "
                               "where it stopped at the next start") from None
    if proc.returncode != 0 or not lib.exists():
        tail = (err or out).strip().splitlines()[-3:]
        raise RuntimeError("compile failed: " + " | ".join(tail))
    return lib


def _missing_tools() -> str | None:
    from torch.utils.cpp_extension import get_cxx_compiler

    try:
        cxx = get_cxx_compiler()
    except Exception:   # noqa: BLE001 - any failure here means no usable compiler
        cxx = None
    if not cxx or not shutil.which(cxx):
        return "no C++ compiler (install g++)"
    if not shutil.which("ninja"):
        return "no ninja build tool (install ninja-build or `pip install ninja`)"
    return None


def _library() -> tuple[str, Path, Path]:
    name = f"tokentop_qk_{_build_key()}"
    build_dir = cache_dir() / name
    return name, build_dir, build_dir / f"{name}.so"


def _disabled() -> bool:
    return os.environ.get("TOKENTOP_KERNELS", "").lower() in ("0", "off", "torch")


def build_pending() -> bool:
    """Whether load() would have to compile first: the library of these sources, this torch
    and this CPU is not in the cache, and a compiler is there to build it."""
    if is_loaded() or _disabled() or _library()[2].exists():
        return False
    return _missing_tools() is None


def start_background_build() -> threading.Thread:
    """Compile the library in a thread (the compiler itself in a niced child process) and
    leave it unloaded: until background_build_done(), load() and available() answer False at
    once, so a worker builds its model on the torch fallback and serves; it switches to the
    kernels between steps once the build is done (engine/worker/loop.py)."""
    _state["deferred"] = True

    def build() -> None:
        name, build_dir, lib = _library()
        try:
            _compile(name, build_dir)
        except Exception as exc:   # noqa: BLE001 - reported when the worker asks, not here
            _state["build_error"] = str(exc)

    thread = threading.Thread(target=build, name="tokentop-kernel-build", daemon=True)
    _state["build_thread"] = thread
    thread.start()
    return thread


def background_build_done() -> bool:
    thread = _state.get("build_thread")
    return thread is not None and not thread.is_alive()


def finish_background_build() -> bool:
    """Load what the background build made (or record why it failed); as load()."""
    _state["deferred"] = False
    _state["build_thread"] = None
    error = _state.pop("build_error", None)
    if error is not None:
        return _fail(error)
    return load()


def load() -> bool:
    """Build (first time) and load the op; False, with the reason logged once, if it cannot."""
    if _state["available"] is not None:
        return _state["available"]
    if _state.get("deferred"):   # building in the background: the torch fallback until it is done
        return False
    if _disabled():
        return _fail("disabled by TOKENTOP_KERNELS")
    name, build_dir, lib = _library()
    if not lib.exists():
        missing = _missing_tools()
        if missing:
            return _fail(missing)
    t0 = time.perf_counter()
    try:
        if not lib.exists():
            log.info("compiling the quantized kernels (once, about a minute) into %s", build_dir)
            lib = _compile(name, build_dir)
        torch.ops.load_library(str(lib))
    except Exception as exc:   # noqa: BLE001 - any build/load failure means: use the torch path
        return _fail(str(exc))
    _state.update(available=True, library=str(lib), build_s=round(time.perf_counter() - t0, 1))
    _register_fake()
    log.info("quantized kernels: %s (%s)", isa_name(), lib.name)
    return True


def _fail(reason: str) -> bool:
    _state.update(available=False, reason=reason)
    log.warning("quantized kernels unavailable (%s): linear layers use dense torch matmuls, "
                "slower and larger in memory", reason)
    return False


_fakes_registered = False


def _register_fake() -> None:
    global _fakes_registered
    if _fakes_registered:   # the library loaded again in this process (a test resets _state)
        return
    _fakes_registered = True

    @torch.library.register_fake("tokentop::qmatmul")
    def _(x, weights, types, rows, bias=None, isa=-1, small_m=-1, big_m=-1):
        return x.new_empty(x.shape[0], sum(rows))

    @torch.library.register_fake("tokentop::add_rms_norm")
    def _(x, delta, w, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("tokentop::act_mul")
    def _(gate_up, act):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("tokentop::rope_store_kv")
    def _(qkv, cos, sin, qk_norm, eps, q_scale, n_heads, n_kv, interleaved, k_store, v_store, slots):
        return qkv.new_empty(qkv.shape[0], n_heads, cos.shape[1])

    @torch.library.register_fake("tokentop::decode_attention")
    def _(q, k_store, v_store, slots, lengths, softcap):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    @torch.library.register_fake("tokentop::gguf_rows_dot")
    def _(h, weight, type, ids):
        return h.new_empty(ids.shape[0], ids.shape[1])

    @torch.library.register_fake("tokentop::top_candidates")
    def _(logits, k):
        return logits.new_empty(logits.shape[0], k, dtype=torch.int64)

    @torch.library.register_fake("tokentop::greedy_pick")
    def _(logits, logprobs=True):
        R = logits.shape[0]
        return (logits.new_empty(R, dtype=torch.int64), logits.new_empty(R),
                logits.new_empty(R, dtype=torch.bool))


def available() -> bool:
    return load()


def is_loaded() -> bool:
    """Whether load() already ran in this process (it may have to compile)."""
    return _state["available"] is not None


def building() -> bool:
    """A background build is under way (start_background_build) and not yet loaded."""
    return bool(_state.get("deferred"))


def describe() -> str:
    """One line for `tokentop models` and the start-up log."""
    if building():
        return "quantized kernels: building in the background; dense torch matmuls until then"
    if not load():
        return f"quantized kernels: unavailable ({_state['reason']}); dense torch matmuls"
    larger = "unpacked panels" if isa_name() in ("avx512", "avx2") else "unpacked tiles"
    n = direct_rows()
    what = (f"every call size runs on the GGUF bytes (direct block-to-register kernels up to {n} "
            f"row{'s' if n != 1 else ''}, {larger} above)")
    if isa_name() == "avx512" and n == 1:      # the packed copies are on
        one_row = "Q5_0, Q8_0 and K-quants" if torch.ops.tokentop.one_row_packed(12) else "Q5_0 and Q8_0"   # 12: Q4_K
        what = (f"direct block-to-register kernels for one row, panels above; 2-32 rows ({one_row}: 1-32) "
                "from copies packed at load (TOKENTOP_PACKED=0: none)")
    return f"quantized kernels: GGUF-native, {isa_name()} (best on this CPU: {isa_name(best_isa())}); {what}"


def best_isa() -> int:
    """Highest ISA level the CPU runs (0 scalar, 1 avx2, 2 avx512)."""
    return int(torch.ops.tokentop.best_isa())


def isa_name(level: int | None = None) -> str:
    """The ISA the op uses by default (after TOKENTOP_KERNEL_ISA), or `level`'s name."""
    if level is None:
        level = int(torch.ops.tokentop.env_isa())
    return ISA_NAMES[level]


def direct_rows(isa: str | None = None) -> int:
    """Calls of at most this many rows take the direct (decode) kernels by default (on `isa`, or
    the default ISA); larger ones the panels or tiles. 0 where it has no direct kernels (portable)."""
    return int(torch.ops.tokentop.direct_rows(-1 if isa is None else _isa_level(isa)))


def batch_rows() -> int:
    """The fewest rows for which a call takes the kernel of batches and prefill by default (the
    panels on AVX-512 and AVX2, the portable row kernel elsewhere)."""
    return int(torch.ops.tokentop.batch_rows())


def lane_rows() -> int:
    """The fewest rows (up to 8) for which a Q8_0 call takes the AVX2 row-lane kernel by
    default; 0 where none does (AVX-512, AVX-VNNI, the portable path)."""
    return int(torch.ops.tokentop.lane_rows())


def packed_bytes() -> int:
    """Bytes held by the packed copies of K-quant matrices (AVX-512 panels; qmatmul_op.cpp):
    memory the engine takes beside the mmap'd model file."""
    return int(torch.ops.tokentop.packed_bytes()) if load() else 0


def status() -> dict:
    """For `tokentop models` and the start-up log."""
    ok = load()
    return {"available": ok, "isa": isa_name() if ok else None, "reason": _state["reason"],
            "build_s": _state["build_s"]}


@functools.cache
def _isa_level(name: str) -> int:
    return ISA_NAMES.index(name)


def qmatmul(x: torch.Tensor, weights: list[torch.Tensor], types: list[int], rows: list[int],
            bias: torch.Tensor | None = None, isa: str | None = None,
            small_m: int = -1, big_m: int = -1) -> torch.Tensor:
    """fp32 x [M, K] times the stacked GGUF matrices (uint8 [rows_i, row_bytes]) transposed.
    small_m: calls of at most this many rows use the direct (decode) kernels; -1 the op's
    default (direct_rows()), 0 never (one kernel for every row count: batch-invariant).
    big_m: calls of at least this many rows use the panel (prefill) kernel where the ISA has
    it; -1 the op's default (above direct_rows(), none with small_m=0), 0 never."""
    level = -1 if isa is None else _isa_level(isa)
    return torch.ops.tokentop.qmatmul(x, weights, types, rows, bias, level, small_m, big_m)
