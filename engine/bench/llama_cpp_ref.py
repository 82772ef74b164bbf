"""llama.cpp on the same GGUF file, for side-by-side ratios (`bench single --llama-cpp PY`).

Runs under another interpreter that has llama-cpp-python installed (not a tokentop
dependency); imports nothing from tokentop. Same protocol as bench single: n_threads, a
500-token prompt (prefill), then 128 greedy tokens from a short prompt (decode).
Prints one JSON object.
"""
import json
import resource
import sys
import time

N_CTX = 2048   # its KV cache: n_ctx positions, allocated (and zeroed) up front

def main(path: str, threads: int, runs: int, prompt_len: int, out_tokens: int) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_ctx=N_CTX, n_batch=512, verbose=False)
    filler = ("The scheduler admits requests in arrival order, charges each step against a token "
              "budget, and preempts the youngest sequence when the page pool runs dry. ")
    base = llm.tokenize((filler * 40).encode(), add_bos=False)
    prefill, decode = [], []
    llm.eval(base[:16])          # warm-up
    for r in range(runs):
        llm.reset()
        ids = llm.tokenize(f"run {r}: ".encode(), add_bos=False) + base
        ids = ids[:prompt_len]
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill.append(len(ids) / (time.perf_counter() - t0))
        llm.reset()
        short = (llm.tokenize(f"decode {r}: ".encode(), add_bos=False) + base)[:16]
        llm.eval(short)
        t0 = time.perf_counter()
        for _ in range(out_tokens):
            tok = llm.sample(temp=0.0)
            llm.eval([tok])
        decode.append(out_tokens / (time.perf_counter() - t0))
    now = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                now[{"VmRSS": "rss_mb", "RssAnon": "anon_mb", "RssFile": "file_mb"}[key]] = \
                    round(int(line.split()[1]) / 1024, 1)
    print(json.dumps({"prefill_tok_s": prefill, "decode_tok_s": decode,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "rss_after_runs": now, "n_ctx": N_CTX, "kv_dtype": "f16 (llama.cpp default)"}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
