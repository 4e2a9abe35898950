"""The teacher-forcing pass of a run (``fidelity``): each problem's full-cache reference trajectory forced
through every method, log-probs compared in chunks of [1024, vocab] rows, and full's own noise floor
(forced in chunks of w against one chunk). A mixin of the eval's runner: it reads the runner's config, problems,
units, references and engine."""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from vase.eval.config import FULL
from vase.eval.metrics import aggregate_fidelity, fidelity_metrics, first_evicted_target, kl_per_token
from vase.eval.prompts import build_user_message
from vase.eval.sample_rows import sample_seed
from vase.eval.store import JsonlStore

__all__ = ["FidelityPass"]

# Rows of the [T, vocab] log-prob matrices turned into float64 at a time by the fidelity metrics.
_FIDELITY_CHUNK = 1024


class FidelityPass:
    """The runner's ``_fidelity`` (one problem, every pending method) and ``_noise_floor``."""

    def _fidelity(self, i: int, store: JsonlStore, done: set) -> int:
        """Teacher-force problem i's reference trajectory through every pending method; records written."""
        c = self.config
        p = self.problems[i]
        pending = [u for u in self.units if (u.label, u.budget, p.id) not in done]
        if not pending:
            return 0
        ref = self.references.get(p.id)
        if ref is None or "token_ids" not in ref:
            warnings.warn(f"fidelity: no full-cache reference trajectory for {p.id}; skipped", stacklevel=2)
            return 0
        targets = list(ref["token_ids"])
        seed0 = sample_seed(c.seed, i, 0)
        base = {"problem_id": p.id, "problem_index": i, "seed": seed0, "rank": self.rank}
        written = 0
        if not targets:  # the reference stopped at once: nothing to compare
            for u in pending:
                store.append({**base, "method": u.label, "budget": u.budget, "n_tokens": 0, "kl_mean": None,
                              "top1_agree": None, "top1_disagree_share": None, "dnll_mean": None, "seconds": 0.0})
                done.add((u.label, u.budget, p.id))
                written += 1
            return written
        from vase.generation.generate import encode_prompts

        ids, _ = encode_prompts(self.tokenizer, [build_user_message(p)], c.chat_template)
        prompt_ids = ids[0].tolist()
        if "prompt_length" in ref and len(prompt_ids) != int(ref["prompt_length"]):
            raise RuntimeError(f"fidelity: prompt of {p.id} encodes to {len(prompt_ids)} tokens, but generation "
                               f"saw {ref['prompt_length']}")
        target_t = torch.tensor(targets, dtype=torch.long)
        t0 = time.perf_counter()
        # the reference: full at its placeholder, the request the config validated (its door) and generated with
        full_lp = self.engine.forced_log_probs(prompt_ids, targets, request=c.request(FULL, None), seed=seed0)
        full_seconds = time.perf_counter() - t0
        for u in pending:
            spec = self.specs[u.label]
            t0 = time.perf_counter()
            extra: dict[str, Any] = {}
            if u.label == FULL:
                comp = full_lp  # the reference against itself: zero by definition
                extra = self._noise_floor(prompt_ids, targets, full_lp, target_t, seed0)
            else:
                comp = self.engine.forced_log_probs(prompt_ids, targets, request=c.request(u.label, u.budget),
                                                    seed=seed0)
            m = _chunked_fidelity(full_lp, comp, target_t)
            # Means over the targets after the first eviction only: earlier ones are full's own and dilute it.
            # Selection (Quest) is measured from the same target on as the eviction methods at its budget.
            t_ev = first_evicted_target(len(prompt_ids), budget=u.budget, window=c.window,
                                        evicts=spec.evicts or spec.policy.selects)
            extra["first_evicted"] = t_ev
            extra["n_tokens_evicted"] = max(0, len(targets) - t_ev) if t_ev is not None else 0
            if t_ev is not None and t_ev < len(targets):
                me = _chunked_fidelity(full_lp[t_ev:], comp[t_ev:], target_t[t_ev:])
                extra.update(kl_mean_evicted=me["kl_mean"], top1_agree_evicted=me["top1_agree"],
                             dnll_mean_evicted=me["dnll_mean"])
            del comp
            store.append({**base, "method": u.label, "budget": u.budget, "n_tokens": int(m["n_tokens"]),
                          "kl_mean": m["kl_mean"], "top1_agree": m["top1_agree"],
                          "top1_disagree_share": m["top1_disagree_share"], "dnll_mean": m["dnll_mean"], **extra,
                          "seconds": time.perf_counter() - t0 + (full_seconds if u.label == FULL else 0.0)})
            done.add((u.label, u.budget, p.id))
            written += 1
        return written


    def _noise_floor(self, prompt_ids: list[int], targets: list[int], full_lp: torch.Tensor, target_t: torch.Tensor,
                     seed: int) -> dict[str, Any]:
        """Full against full teacher-forced in chunks of ``w`` (the compressed caches' feeding): the KL that
        arithmetic alone produces. None when the forced function has no ``max_chunk`` argument."""
        try:
            request = self.config.request(FULL, max(self.config.budgets, default=512))  # validated at the config
            chunked = self.engine.forced_log_probs(prompt_ids, targets, request=request, seed=seed,
                                                   max_chunk=self.config.window)
        except TypeError:  # a stand-in forced function without chunking
            return {"noise_kl_mean": None, "noise_top1_agree": None}
        m = _chunked_fidelity(full_lp, chunked, target_t)
        # Per target (4 significant digits), so a summary takes the noise over each budget's own KL targets.
        per = torch.cat([kl_per_token(full_lp[a:a + _FIDELITY_CHUNK], chunked[a:a + _FIDELITY_CHUNK])
                         for a in range(0, full_lp.shape[0], _FIDELITY_CHUNK)])
        return {"noise_kl_mean": m["kl_mean"], "noise_top1_agree": m["top1_agree"],
                "noise_kl_tokens": [float(f"{v:.4g}") for v in per.tolist()]}


def _chunked_fidelity(full_lp: torch.Tensor, comp_lp: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """fidelity_metrics over row chunks, pooled (bounds the float64 copies to a chunk)."""
    T = full_lp.shape[0]
    targets = targets.to(full_lp.device)
    parts = [fidelity_metrics(full_lp[a:a + _FIDELITY_CHUNK], comp_lp[a:a + _FIDELITY_CHUNK],
                              targets[a:a + _FIDELITY_CHUNK]) for a in range(0, T, _FIDELITY_CHUNK)]
    return parts[0] if len(parts) == 1 else aggregate_fidelity(parts)
