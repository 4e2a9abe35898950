"""Bit-identity check for refactors: record what the engines produce on many scenarios, compare later.

    PYTHONPATH=src python benchmarks/bit_identity.py record /tmp/before.json [--vllm]
    PYTHONPATH=src python benchmarks/bit_identity.py compare /tmp/before.json /tmp/after.json

Transformers scenarios (float64 tiny Qwen3, batch 2 with left padding, seeded sampling): every registered
method, eager and compiled (`compile="eager"`: the static cache's step through torch.compile's eager
backend, so no inductor build), dense and `kv_bits=4`. Per scenario: the tokens, a SHA-256 of every logits
tensor the sampler read, the cache stats and per-row stats; or the refusal's type and message. With
`--vllm`: the plugin on a tiny float32 Llama (in-process CPU engine), greedy, a batch of three prompts of
different lengths, for several methods: tokens, top-5 log-probs and the kept positions at every eviction.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests.conftest / tests.vllm_tiny



def _scenarios(quick: bool) -> list[dict]:
    from vase.core.policies import method_names

    out = []
    for method in method_names():
        for compiled in (False, "eager"):
            for bits in (None, 4):
                out.append({"method": method, "compile": compiled, "kv_bits": bits})
    return out[:8] if quick else out


def _run_tf(sc: dict) -> dict:
    import vase
    from vase.generation import decoding
    from tests.conftest import F64, tiny_model, tiny_tokenizer

    torch.set_num_threads(1)
    model, tok = tiny_model(dtype=F64), tiny_tokenizer()
    digests: list[str] = []
    original = decoding.Sampler.__call__

    def recording(self, logits, generators):
        digests.append(hashlib.sha256(logits.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16])
        return original(self, logits, generators)

    decoding.Sampler.__call__ = recording
    kw = {} if sc["kv_bits"] is None else {"kv_bits": sc["kv_bits"]}
    try:
        out = vase.generate(model, tok, ["the quick brown fox jumps over", "a b c"], method=sc["method"],
                            budget=12, window=4, max_new_tokens=40, seed=3, chat_template=False, ignore_eos=True,
                            compile=sc["compile"], **kw)
        return {"tokens": out.token_ids, "logits": hashlib.sha256("".join(digests).encode()).hexdigest(),
                "steps": len(digests), "stats": {k: v for k, v in out.stats.items() if "second" not in k}}
    except Exception as e:  # a refusal is behaviour too
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        decoding.Sampler.__call__ = original


def _run_vllm() -> dict:
    from tests.vllm_tiny import save_tiny_llama, start_llm, vllm_batch
    from vase.vllm import additional_config

    path = save_tiny_llama(os.path.join(tempfile.gettempdir(), "vase-bitid-llama"))
    options = dict(model=path, max_model_len=512, kv_cache_memory_bytes=40 * 32 * 2 * 2 * 2 * 32 * 4,
                   block_size=32, enforce_eager=True, dtype="float32", seed=0, max_num_seqs=8,
                   enable_chunked_prefill=True, max_num_batched_tokens=64)
    llm = start_llm(options, additional_config("h2o", 48, 16))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (20, 7, 60)]
    out = {}
    for method in ("streamingllm", "snapkv", "h2o", "rkv", "vase-attnv", "vase-dkv", "tova", "knorm"):
        rows = vllm_batch(llm, method, prompts, 90)
        out[method] = [{"tokens": r["tokens"],
                        "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in r["logprobs"]],
                        "kept": {str(k): v for k, v in r["kept"].items()}} for r in rows]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=["record", "compare"])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.action == "compare":
        a, b = (json.load(open(p)) for p in args.paths[:2])
        bad = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        print(f"{len(a)} vs {len(b)} scenarios; {len(bad)} differ" + (": " + ", ".join(bad) if bad else ""))
        sys.exit(1 if bad else 0)
    record = {}
    for sc in _scenarios(args.quick):
        key = f"tf/{sc['method']}/compile={sc['compile']}/kv_bits={sc['kv_bits']}"
        record[key] = _run_tf(sc)
        print(key, "error" if "error" in record[key] else "ok", flush=True)
    if args.vllm:
        for method, rows in _run_vllm().items():
            record[f"vllm/{method}"] = rows
            print(f"vllm/{method} ok", flush=True)
    with open(args.paths[0], "w") as f:
        json.dump(record, f, indent=0, sort_keys=True, default=str)


if __name__ == "__main__":
    main()
