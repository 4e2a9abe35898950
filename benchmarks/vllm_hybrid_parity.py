"""The vLLM plugin on sliding-window hybrids (tiny Gemma 3 and gpt-oss, fp32) against vase's transformers engine:
per request, tokens equal, evictions, kept sets equal, log-prob gap; written to docs/results/vllm-hybrid-parity.json.

    PYTHONPATH=src .venv/bin/python benchmarks/vllm_hybrid_parity.py [docs/results/vllm-hybrid-parity.json]

Runs what tests/test_vllm_hybrid.py runs (same engines, prompts, B, w, 150 greedy tokens) and records it in full.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_vllm_exact import _compare, prompt_ids  # noqa: E402
from tests.test_vllm_hybrid import B, BLOCK, N_NEW, W, _transformers_run, _vllm_run, save_tiny_hybrid  # noqa: E402
from tests.vllm_tiny import start_llm  # noqa: E402
from vase.files.provenance import finish, provenance, write_results  # noqa: E402
from vase.vllm import additional_config  # noqa: E402


def main(out: str) -> None:
    record = provenance(settings=dict(budget=B, window=W, new_tokens=N_NEW, block_size=BLOCK, dtype="float32",
                                      prompts=[20, 60, 7]))
    rows = []
    for family in ("gpt-oss", "gemma3"):
        path = save_tiny_hybrid(family, tempfile.mkdtemp(prefix=f"tiny-{family}-"))
        llm = start_llm(dict(model=path, max_model_len=512, kv_cache_memory_bytes=2**22, block_size=BLOCK,
                             enforce_eager=True, dtype="float32", seed=0, max_num_seqs=8, enable_chunked_prefill=True,
                             max_num_batched_tokens=64),
                        additional_config("snapkv", B, W))
        for method in ("snapkv", "h2o", "vase-attnv"):
            prompts = [prompt_ids(20, 40), prompt_ids(60, 42), prompt_ids(7, 41)]
            ours, seen = _vllm_run(llm, method, prompts, N_NEW)
            for run, ids in zip(ours, prompts):
                ref = _transformers_run(path, method, ids, N_NEW)
                got = _compare(run, ref, len(ids))
                same = next((t for t, (a, b) in enumerate(zip(run["tokens"], ref["tokens"])) if a != b), N_NEW)
                worst = max(abs(lp.logprob - float(ref["logps"][t, tok])) for t in range(min(same, N_NEW))
                            for tok, lp in run["logprobs"][t].items())
                rows.append({"family": family, "method": method, "prompt": len(ids),
                             "tokens equal": f"{same} of {N_NEW}",
                             "evictions (reference)": len(ref["kept"]),
                             "kept sets equal": f"{sum(run['kept'].get(s) == k for s, k in ref['kept'].items())} "
                                                f"of {len(ref['kept'])}",
                             "largest top-5 log-prob gap": f"{worst:.1e}",
                             "evictions before the first near-tie": got["evictions"]})
                print(rows[-1], flush=True)
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        del llm
        cleanup_dist_env_and_memory()
    write_results(out, rows, finish(record), table={"align": "llrrrrrr"})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/results/vllm-hybrid-parity.json")
