"""Looking inside: value statistics, kept-token maps, loop onset, and the inspect command."""

from __future__ import annotations

import json

import torch

from vase.analysis import kept_map, loop_onset, value_statistics
from vase.analysis.inspect import inspect_generation
from vase.caches.eager import EvictionCache
from vase.hf.compat import cache_kwargs

from .conftest import tiny_model, tiny_tokenizer


def test_value_statistics_find_injected_outliers():
    torch.manual_seed(0)
    values = torch.randn(1, 2, 50, 8)
    values[0, 1, 17] *= 40.0  # one abnormally large value vector
    stats = value_statistics([values, torch.randn(1, 2, 50, 8)])
    assert stats[0]["top_positions"][0] == 17 and stats[0]["max_over_median"] > 10
    assert abs(stats[0]["share_over_threshold"] - 1 / 100) < 1e-6  # one (head, position) of 2 x 50
    assert stats[1]["max_over_median"] < 5


def test_kept_map_matches_cache_positions():
    model = tiny_model()
    cache = EvictionCache(model, "streamingllm", budget=12, window=4)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 90, (1, 12)), **cache_kwargs(cache))
        for t in range(12, 17):  # the cache fills to B + w = 16, the 5th token evicts first
            out = model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[t]]), **cache_kwargs(cache))
    kept = kept_map(cache)
    assert kept.shape == (2, 2, 17)
    # StreamingLLM keeps the sinks 0-3 and the 4 most recent candidates 8-11, then the window 12-15 and token 16
    expected = torch.zeros(17, dtype=torch.bool)
    expected[[0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16]] = True
    assert torch.equal(kept[0, 0], expected) and torch.equal(kept[1, 1], expected)
    assert out.logits.shape[1] == 1


def test_loop_onset():
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    text = "Let us think about the problem. " + "the answer is 42, " * 12
    ids = [ord(c) for c in text]
    onset = loop_onset(ids, decode)
    phrase = len("the answer is 42, ")
    # The fifth copy completes the loop (a 4-60 character phrase needs 5), at its comma: the trailing space is not
    # needed. Exactly, and equal to the shortest looping prefix found by a linear scan (the binary search's answer).
    from vase.eval.failures import has_loop

    assert onset == len("Let us think about the problem. ") + 5 * phrase - 1 == 121
    assert onset == next(n for n in range(1, len(ids) + 1) if has_loop(decode(ids[:n])))
    assert loop_onset([ord(c) for c in "no loop in this short sentence at all."], decode) is None
    # the prefix up to the onset loops, the one before does not
    from vase.eval.failures import has_phrase_loop

    assert has_phrase_loop(decode(ids[:onset])) and not has_phrase_loop(decode(ids[:onset - 1]))


def test_inspect_generation_writes_report(tmp_path):
    model, tok = tiny_model(), tiny_tokenizer()
    report = inspect_generation(model, tok, "hello", tmp_path, method="vase-attnv", budget=20, window=6,
                                max_new_tokens=40, greedy=True, chat_template=False)
    assert (tmp_path / "kept.png").stat().st_size > 0
    saved = json.loads((tmp_path / "inspect.json").read_text())
    assert saved["stats"]["evictions"] == report["stats"]["evictions"] > 0
    assert len(saved["values"]) == 2 and all(0 < s < 1 for s in saved["kept_share_per_layer"])
