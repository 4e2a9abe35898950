"""vase against NVIDIA kvpress 0.5.5 (the library users would pick instead), side by side on one machine.

    python benchmarks/peer_kvpress.py --tokens 1024,4096 --budget 512 --window 64 --rounds 3 --threads 1 \
        --results docs/results/peer-kvpress.json

kvpress 0.5.5 needs transformers < 5.3 and vase >= 5.16.1, so they cannot share a process: the
script builds kvpress its own virtual environment (`--venv`, default ~/.cache/vase/kvpress-0.5.5:
`torch==2.13.0 kvpress==0.5.5`, once) and runs each measurement in a fresh process, alternating
(kvpress, vase, kvpress, vase, ...) so the machine's load hits both alike; the vase/kvpress ratio
is taken within each round (`vase.bench.paired`), median and range over rounds.

Both sides run the same thing: the same model shapes (`--shape`, random weights in float32 from
the same seed), the same random prompt, the same hand-written greedy decode loop of exactly
`--tokens` new tokens (no EOS: the loop never stops early), one row, `--threads` CPU threads:

- kvpress: transformers' DynamicCache under `DecodingPress(KnormPress(), compression_interval=w,
  target_size=B)` (or `--press snapkv`: SnapKVPress over the w - 1 last of a w-token hidden-state buffer): every w
  decoding steps each layer is compressed back to B tokens;
- vase: `EvictionCache(model, "knorm" | "snapkv", B, w)`: evicts to B every w tokens.

Reported per side: decode tok/s (prefill excluded; also per CPU second of the process, which on a
loaded shared machine leaves out the time other processes took), the process's peak resident memory during the
run (VmHWM reset before the prefill; weights included) and its rise over the RSS before it, and
the K/V bytes and tokens held at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVPRESS = "kvpress==0.5.5"
TORCH = "torch==2.13.0"
LIBRARIES = ("kvpress", "vase", "vase-compiled")
VERSION = {"kvpress": KVPRESS, "vase": "vase (this commit)", "vase-compiled": "vase compiled (this commit)"}
# How scripts/render_docs.py draws the results file in docs/bench.md.
TABLE = {"columns": ["library", "method", "new tokens", "B / w", "tok/s per CPU second (median)", "tok/s wall (median)",
                     "vs kvpress per CPU second (paired, range)", "vs kvpress wall (paired, range)", "peak RSS MiB",
                     "K/V held MiB"],
         "keys": ["version", "method", "new_tokens", "bw", "cpu_tok_s", "tok_s", "cell_vs_cpu", "cell_vs_wall",
                  "cell_rss", "cell_kv"],
         "align": "llrrrrrrrr", "formats": {"cpu_tok_s": ".2f", "tok_s": ".2f"}}


def _ratio_cell(ratio: tuple[float, float, float]) -> str:
    """'1.07x (1.02x-1.12x)': a paired ratio's median and range over the rounds."""
    return f"{ratio[0]:.2f}x ({ratio[1]:.2f}x-{ratio[2]:.2f}x)"


# -- the worker (runs under either interpreter; imports neither library at module level) --------------------------
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(args.threads)
    spec = json.loads(Path(args.config).read_text())
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    vocab = config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_length), generator=torch.Generator().manual_seed(0))
    P, N, B, w = args.prompt_length, args.tokens, args.budget, args.window

    if args.worker == "kvpress":
        from kvpress import DecodingPress, KnormPress, SnapKVPress

        # SnapKVPress needs more buffered queries than its window; the buffer holds the w since the last compression
        base = KnormPress() if args.press == "knorm" else SnapKVPress(window_size=w - 1)
        press = DecodingPress(base_press=base, compression_interval=w, target_size=B,
                              hidden_states_buffer_size=w if args.press == "snapkv" else 0)
        cache = DynamicCache()
        context = press(model)
        kwarg = "past_key_values"
    else:
        sys.path.insert(0, str(ROOT / "src"))
        from vase.caches.eager import EvictionCache
        from vase.hf.compat import CACHE_KWARG

        if args.worker == "vase-compiled":
            return _compiled_worker(model, prompt, args)
        cache = EvictionCache(model, args.press, B, w, max_length=P + N)
        from contextlib import nullcontext

        context = nullcontext()
        kwarg = CACHE_KWARG

    rss_before = _status("VmRSS")
    _reset_hwm()
    with torch.inference_mode(), context:
        out = model(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                    position_ids=torch.arange(P)[None], use_cache=True, logits_to_keep=1, **{kwarg: cache})
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        generated = [int(token)]
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(N - 1):  # N tokens: the first came from the prefill
            out = model(input_ids=token, position_ids=torch.tensor([[P + i]]), use_cache=True, logits_to_keep=1,
                        **{kwarg: cache})
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            generated.append(int(token))
        decode_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    peak = _status("VmHWM")
    if args.worker == "kvpress":
        layers = cache.layers
        kv = sum(t.numel() * t.element_size() for l in layers for t in (l.keys, l.values))
        stored = int(layers[0].keys.shape[2])
    else:
        stats = cache.stats()
        kv, stored = stats["kv_bytes"], stats["stored_length"]
    _report(args.worker, len(generated), N, decode_s, cpu_s, peak, rss_before, kv, stored)


def _report(library: str, tokens: int, N: int, decode_s: float, cpu_s: float, peak: int, rss_before: int, kv: int,
            stored: int) -> None:
    import torch
    import transformers

    print("RESULT " + json.dumps({
        "library": library, "tokens": tokens, "decode_s": decode_s, "tok_s": (N - 1) / decode_s,
        "decode_cpu_s": cpu_s, "cpu_tok_s": (N - 1) / cpu_s,
        "peak_rss_bytes": peak, "rss_before_bytes": rss_before, "peak_rss_delta_bytes": max(0, peak - rss_before),
        "kv_bytes": kv, "stored_length": stored, "transformers": transformers.__version__,
        "torch": torch.__version__}), flush=True)


def _compiled_worker(model, prompt, args: argparse.Namespace) -> None:
    """vase's compiled decode (`vase.generation.compiled.decode_compiled`: the steps over the fixed-size static cache run
    as torch.compile'd graphs). One untimed run first compiles the plain and the evicting graph; the timed run
    starts at its first token (the prefill's), as the hand-written loop does, and runs the same N - 1 forwards."""
    import torch

    from vase.caches.eager import EvictionCache
    from vase.generation.compiled import decode_compiled
    from vase.generation.decoding import Sampler

    P, N, B, w = args.prompt_length, args.tokens, args.budget, args.window
    mask = torch.ones_like(prompt)
    greedy = Sampler(greedy=True)

    def run(tokens: int, on_token=None) -> list[list[int]]:
        cache = EvictionCache(model, args.press, B, w, max_length=P + tokens)
        ids, _, _ = decode_compiled(model, prompt, mask, cache, max_new_tokens=tokens, sampler=greedy, seeds=[0],
                                    ignore_eos=True, on_token=on_token)
        return ids

    run(min(N, max(B + 3 * w - P, 2 * w)))  # compiles both graphs (untimed): past the first evictions
    start: list[float] = []

    def first_token(row: int, token: int) -> None:
        if not start:
            start.extend((time.perf_counter(), time.process_time()))

    rss_before = _status("VmRSS")
    _reset_hwm()
    ids = run(N, first_token)
    decode_s, cpu_s = time.perf_counter() - start[0], time.process_time() - start[1]
    peak = _status("VmHWM")
    stats = decode_compiled.last_cache.stats()
    _report("vase-compiled", len(ids[0]), N, decode_s, cpu_s, peak, rss_before, stats["kv_bytes"],
            stats["stored_length"])


# -- the parent ---------------------------------------------------------------------------------------------------
def ensure_venv(venv: Path) -> Path:
    """The kvpress environment's python, built once (`torch==2.13.0 kvpress==0.5.5`)."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import kvpress"], capture_output=True).returncode == 0:
        return python
    print(f"building {venv}: {TORCH} {KVPRESS} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", TORCH, KVPRESS], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"peer_kvpress: pip install {TORCH} {KVPRESS} into {venv} failed: {tail}")
    return python


def run_worker(python: str, library: str, length: int, args: argparse.Namespace, config: Path) -> dict:
    cmd = [python, __file__, "--worker", library, "--config", str(config), "--tokens", str(length),
           "--budget", str(args.budget), "--window", str(args.window), "--prompt-length", str(args.prompt_length),
           "--threads", str(args.threads), "--press", args.press]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # each side sees only its own environment's packages
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        sys.exit(f"peer_kvpress: the {library} worker failed ({length} tokens):\n{tail}")
    result = json.loads(lines[-1][len("RESULT "):])
    if result["tokens"] != length:
        sys.exit(f"peer_kvpress: {library} produced {result['tokens']} tokens, expected {length}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,4096", help="comma-separated new tokens per run (fixed length)")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (kvpress, vase) per length")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--press", choices=("knorm", "snapkv"), default="knorm")
    ap.add_argument("--shape", default="smollm2-135m", help="a vase.bench shape name or a config.json")
    ap.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "vase" / "kvpress-0.5.5")
    ap.add_argument("--results", type=Path, default=None, help="results file (JSON with provenance)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per worker run")
    ap.add_argument("--libraries", default="kvpress,vase",
                    help="comma-separated sides, run in this order each round: kvpress, vase (eager decode), "
                         "vase-compiled (vase's torch.compile'd decode; compiling is untimed)")
    ap.add_argument("--worker", choices=LIBRARIES, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.tokens = int(args.tokens)
        return worker(args)

    sys.path.insert(0, str(ROOT / "src"))
    from vase.bench.paired import alternating, paired_ratio
    from vase.bench.shapes import resolve_shape
    from vase.files.provenance import finish, provenance, write_results

    lengths = [int(x) for x in args.tokens.split(",") if x.strip()]
    if not lengths or min(lengths) < 2 or args.rounds < 1:
        sys.exit("peer_kvpress: --tokens needs lengths >= 2 and --rounds >= 1")
    libraries = [x.strip() for x in args.libraries.split(",") if x.strip()]
    if (libraries[:1] != ["kvpress"] or len(libraries) < 2 or not set(libraries) <= set(LIBRARIES)
            or len(set(libraries)) != len(libraries)):
        sys.exit(f"peer_kvpress: --libraries must start with kvpress, then one or both of vase, vase-compiled, each "
                 f"once (got {args.libraries!r})")
    record = provenance(threads=args.threads, kvpress=KVPRESS)
    kv_python = str(ensure_venv(args.venv))
    config = Path(os.environ.get("TMPDIR", "/tmp")) / f"peer-kvpress-{os.getpid()}.json"
    spec = resolve_shape(args.shape).to_dict()
    config.write_text(json.dumps(spec))
    rows = []
    try:
        for length in lengths:
            runs: dict[str, list[dict]] = {library: [] for library in libraries}
            for rnd, library in alternating(libraries, args.rounds):
                r = run_worker(kv_python if library == "kvpress" else sys.executable, library, length, args, config)
                runs[library].append(r)
                print(f"{length} tokens, round {rnd}: {library:7s} {r['tok_s']:7.2f} tok/s ({r['cpu_tok_s']:.2f} per CPU "
                      f"second), peak RSS "
                      f"{r['peak_rss_bytes'] / 2**20:7.1f} MiB (+{r['peak_rss_delta_bytes'] / 2**20:.1f}), KV "
                      f"{r['kv_bytes'] / 2**20:.2f} MiB ({r['stored_length']} tokens)", flush=True)
            for library in libraries:
                rs = runs[library]
                vs = library != "kvpress"
                ratio = paired_ratio([r["tok_s"] for r in rs], [r["tok_s"] for r in runs["kvpress"]])
                cpu_ratio = paired_ratio([r["cpu_tok_s"] for r in rs], [r["cpu_tok_s"] for r in runs["kvpress"]])
                rows.append({
                    "library": library, "version": VERSION[library],
                    "decode": "compiled" if library == "vase-compiled" else "eager",
                    "transformers": rs[0]["transformers"], "torch": rs[0]["torch"], "method": args.press,
                    "model": f"random:{args.shape}", "dtype": "float32", "batch": 1, "prompt_length": args.prompt_length,
                    "new_tokens": length, "budget": args.budget, "window": args.window, "threads": args.threads,
                    "rounds": args.rounds, "tok_s": statistics.median(r["tok_s"] for r in rs),
                    "tok_s_runs": ";".join(repr(r["tok_s"]) for r in rs),
                    "cpu_tok_s": statistics.median(r["cpu_tok_s"] for r in rs),
                    "peak_rss_bytes": int(statistics.median(r["peak_rss_bytes"] for r in rs)),
                    "peak_rss_delta_bytes": int(statistics.median(r["peak_rss_delta_bytes"] for r in rs)),
                    "kv_bytes": rs[-1]["kv_bytes"], "stored_length": rs[-1]["stored_length"],
                    "vase_vs_kvpress": ratio[0] if vs else None,
                    "vase_vs_kvpress_lo": ratio[1] if vs else None,
                    "vase_vs_kvpress_hi": ratio[2] if vs else None,
                    "vase_vs_kvpress_cpu": cpu_ratio[0] if vs else None,
                    "vase_vs_kvpress_cpu_lo": cpu_ratio[1] if vs else None,
                    "vase_vs_kvpress_cpu_hi": cpu_ratio[2] if vs else None,
                    "bw": f"{args.budget} / {args.window}", "cell_vs_cpu": _ratio_cell(cpu_ratio) if vs else "-",
                    "cell_vs_wall": _ratio_cell(ratio) if vs else "-",
                    "cell_rss": f"{statistics.median(r['peak_rss_bytes'] for r in rs) / 2**20:.0f}",
                    "cell_kv": f"{rs[-1]['kv_bytes'] / 2**20:.2f}",
                })
                if vs:
                    print(f"{length} tokens: {library} / kvpress tok/s, median of {args.rounds} paired rounds: "
                          f"{ratio[0]:.3f} (range {ratio[1]:.3f}..{ratio[2]:.3f}); by CPU time {cpu_ratio[0]:.3f} "
                          f"({cpu_ratio[1]:.3f}..{cpu_ratio[2]:.3f})", flush=True)
    finally:
        config.unlink(missing_ok=True)
    if args.results:
        print(f"wrote {write_results(args.results, rows, finish(record), TABLE)}")


if __name__ == "__main__":
    main()
