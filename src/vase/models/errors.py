"""The one error type of model loading, and the hub's many errors turned into one line each."""

from __future__ import annotations

__all__ = ["ModelLoadError", "first_line", "hub_error"]


class ModelLoadError(ValueError):
    """A model could not be located, downloaded, verified or loaded."""


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def hub_error(name: str, exc: BaseException) -> ModelLoadError:
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
    return ModelLoadError(f"could not load {name!r} from the Hugging Face hub: {first_line(exc)}")
