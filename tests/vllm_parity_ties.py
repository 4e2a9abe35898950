"""Why test_vllm_exact's parity check tolerates an eviction that exchanges up to MAX_SWAP slot pairs.

    PYTHONPATH=src:. .venv/bin/python tests/vllm_parity_ties.py [METHOD ...]    # default: vase-attnv

Runs the parity test's prompts through the plugin and through vase's transformers engine (the
test's own helpers), and in the transformers run records, at every eviction of every layer and KV
head, the two rankings a selection makes: the value guard's magnitudes (top-k) and the sampling
keys (log weight + Gumbel noise, top-k). For the first eviction whose kept sets differ it prints,
per exchanged pair (a kept by vLLM only, b kept by transformers only), which ranking chose between
them and the gap between their two entries there, beside the median boundary gap of that ranking
over all evictions (k-th minus (k+1)-th entry). A gap at rounding level (float32: about 1e-7
relative) is a tie that the two engines' last bits decide; a gap like the median is a real
difference, and would mean the tolerance hides a bug.

Run on 2026-12-02 (vase-attnv, snapkv-sample, vase-dkv; 4 prompts each): the two differing runs
are both vase-attnv, both start in layer 0 and both come from the value guard ranking two slots
that hold the same token id (17 at positions 12 and 42; 84 at 14 and 30). Layer 0's values depend
on the token only, so the two value norms tie: bit-identical for two prompt tokens, 1.1e-7
relative where transformers computed one in the prefill's GEMM and the other in a decode step,
and each engine's top-k orders the tied pair its own way. First only the slot order differs (same
kept sets, seen at 2 and 3 earlier evictions of layer 0); since SnapKV-style scores max-pool over
neighbouring slots and the noise is drawn per slot, a later eviction then keeps another slot
(in the 33-token run a second pair differs in the sampled part, by 0.05 in the reference's keys).
"""

from __future__ import annotations

import statistics
import sys
import tempfile

import torch

import vase.core.policies.base as policy_base
from vase.caches.eager import EvictionLayer

RECORD: list[dict] = []  # one entry per (eviction, layer): filled by the patches below while the reference runs
ON = [False]  # record only during the transformers run (the plugin's worker runs in this process too)


def _patch() -> None:
    select, sampler, magnitude = EvictionLayer._select, policy_base.sample_without_replacement, \
        policy_base.value_magnitude

    def recording_select(self, rows, pad, n_cand):
        if ON[0]:
            RECORD.append({"seen": self.seen, "layer": self.layer_idx,
                           "positions": self.positions[0, :, pad:n_cand].tolist()})
        return select(self, rows, pad, n_cand)

    def recording_magnitude(values, metric):
        out = magnitude(values, metric)
        if ON[0]:
            RECORD[-1]["magnitude"] = out[0].double()
        return out

    def recording_sampler(weights, k, generator):
        # the same keys the sampler ranks (its generators are the cache's: draw on a copy of their state)
        states = [g.get_state() for g in generator] if ON[0] and isinstance(generator, list) else None
        out = sampler(weights, k, generator)
        if states is not None:
            for g, s in zip(generator, states):
                g.set_state(s)
            keys = policy_base.gumbel_keys(weights, generator)
            RECORD[-1]["sample_keys"] = keys[0].double()
            RECORD[-1]["k"] = k
        return out

    EvictionLayer._select = recording_select
    policy_base.value_magnitude = recording_magnitude
    policy_base.sample_without_replacement = recording_sampler


def _boundary_gaps(entries: list[dict], name: str, k_of) -> list[float]:
    gaps = []
    for e in entries:
        if name not in e:
            continue
        top = e[name].sort(-1, descending=True).values
        k = k_of(e)
        finite = torch.isfinite(top[:, k - 1]) & torch.isfinite(top[:, k])
        gaps += (top[:, k - 1] - top[:, k])[finite].tolist()
    return gaps


def main(methods: list[str]) -> None:
    from tests import test_vllm_exact as exact
    from tests.vllm_tiny import save_tiny_llama
    from vase.vllm import additional_config

    tiny = save_tiny_llama(tempfile.mkdtemp(prefix="tiny-llama-"))
    llm = exact.make_engine(tiny, additional_config("h2o", exact.B_PRE, exact.W_PRE), enable_chunked_prefill=True,
                            max_num_batched_tokens=64)
    prompts = [exact.prompt_ids(20, 40), exact.prompt_ids(7, 41), exact.prompt_ids(60, 42), exact.prompt_ids(33, 44)]
    _patch()
    for method in methods:
        ours_all = exact._vllm_run(llm, method, prompts[:1], exact.N_NEW) + exact._vllm_run(llm, method, prompts[1:],
                                                                                          exact.N_NEW)
        for ours, ids in zip(ours_all, prompts):
            RECORD.clear()
            ON[0] = True
            try:
                ref = exact._transformers_run(tiny, method, ids, exact.N_NEW)
            finally:
                ON[0] = False
            entries = list(RECORD)
            swap = next((s for s in sorted(ref["kept"]) if s in ours["kept"] and ours["kept"][s] != ref["kept"][s]
                         and any(set(a) != set(b) for la, lb in zip(ours["kept"][s], ref["kept"][s])
                                 for a, b in zip(la, lb))), None)
            print(f"{method} prompt {len(ids)}: {len(ref['kept'])} evictions, first kept-set difference at "
                  f"{'none' if swap is None else swap}")
            if swap is None:
                continue
            # Same kept sets can sit in another slot order (a tie's order); the max-pooled scores and the per-slot
            # noise of the next eviction follow the slot order.
            for s in sorted(ref["kept"]):
                if s >= swap:
                    break
                orders = [(layer, head) for layer, (la, lb) in enumerate(zip(ours["kept"][s], ref["kept"][s]))
                          for head, (a, b) in enumerate(zip(la, lb)) if a != b]
                if orders:
                    print(f"  eviction at {s}: same kept sets, slot order differs in (layer, head) {orders}")
            sample_gaps = _boundary_gaps(entries, "sample_keys", lambda e: e["k"])
            print(f"  median boundary gap over all evictions: sampling keys {statistics.median(sample_gaps):.3g} "
                  f"({len(sample_gaps)} heads)")
            for layer, (la, lb) in enumerate(zip(ours["kept"][swap], ref["kept"][swap])):
                entry = next(e for e in entries if e["seen"] == swap and e["layer"] == layer)
                for head, (a_set, b_set) in enumerate(zip(la, lb)):
                    only_ours, only_ref = sorted(set(a_set) - set(b_set)), sorted(set(b_set) - set(a_set))
                    for a, b in zip(only_ours, only_ref):
                        seq = list(ids) + ref["tokens"]
                        print(f"  layer {layer} head {head}: token ids at positions {a} and {b}: {seq[a]}, {seq[b]}")
                        cand = entry["positions"][head]
                        ia, ib = cand.index(a), cand.index(b)
                        for name in ("magnitude", "sample_keys"):
                            if name in entry:
                                va, vb = float(entry[name][head, ia]), float(entry[name][head, ib])
                                print(f"  layer {layer} head {head}: vLLM kept position {a}, transformers {b}; "
                                      f"{name}: {va:.9g} vs {vb:.9g}, gap {vb - va:.3g} "
                                      f"(relative {(vb - va) / max(abs(vb), 1e-30):.2g})")


if __name__ == "__main__":
    main(sys.argv[1:] or ["vase-attnv"])
