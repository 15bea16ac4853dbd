"""Load a model checkpoint (Hugging Face safetensors directory, single safetensors file, or a
llama.cpp GGUF file) into one layout: an HF config dict + HF-named numpy tensors + tokenizer."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import numpy as np

from ..errors import CheckpointError
from .gguf_loader import load_gguf, progress_bar
from .safetensors_loader import load_safetensors_file, shard_files
from .validate import unexpected_tensors, validate_tensors

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer


@dataclass
class Checkpoint:
    config: dict                                # HF-style config.json dict
    tensors: Mapping[str, np.ndarray]           # HF tensor names -> arrays (safetensors: memory-mapped)
    path: Path
    format: str                                 # "safetensors" or "gguf"
    tokenizer: "Tokenizer | None" = None
    notes: list[str] = field(default_factory=list)   # non-fatal remarks (e.g. "no tokenizer: ...")


def load_checkpoint(path: str | Path, progress: bool = True) -> Checkpoint:
    """Load a checkpoint from a model directory, a .gguf file, or a .safetensors file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; check the path or run `kog pull`")
    if path.is_file() and path.suffix == ".gguf":
        config, tensors, tokenizer = load_gguf(path, progress=progress)
        notes = [] if tokenizer else [f"{path.name} has no tokenizer metadata"]
        return Checkpoint(config, tensors, path, "gguf", tokenizer, notes)
    if path.is_file() and path.suffix == ".safetensors":
        return _load_safetensors(path.parent, [path], path, progress)
    if path.is_dir():
        files = shard_files(path)
        if not files:
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:  # e.g. cache_dir()/models/<preset>/ holding one pulled GGUF
                return load_checkpoint(ggufs[0], progress)
            raise CheckpointError(f"{path} holds no model.safetensors (or shards) and no single .gguf file; "
                                  f"is the download complete?")
        return _load_safetensors(path, files, path, progress)
    raise CheckpointError(f"{path} is not a model directory, .gguf or .safetensors file")


def read_config(path: str | Path) -> dict:
    """Only the HF-style config of a checkpoint (no tensor is read or dequantized), so the engine
    can check a backend's capabilities before it loads any weight."""
    from .gguf_loader import gguf_config, metadata, open_reader

    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; check the path or run `kog pull`")
    if path.is_dir() and not shard_files(path):
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.is_file() and path.suffix == ".gguf":
        reader = open_reader(path)
        shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
        return gguf_config(metadata(reader), shapes, path)
    if path.is_dir() and shard_files(path):
        return _read_config(path)
    if path.is_file() and path.suffix == ".safetensors":
        return _read_config(path.parent)
    return load_checkpoint(path, progress=False).config  # the same one-line errors as a full load


def load_tokenizer(path: str | Path) -> "Tokenizer | None":
    """Only the tokenizer of a checkpoint (fast: no weights are read or dequantized); None if it has none."""
    from ..tokenizer import Tokenizer
    from .gguf_loader import metadata, open_reader

    path = Path(path).expanduser()
    if path.is_dir() and not shard_files(path):
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.is_file() and path.suffix == ".gguf":
        meta = metadata(open_reader(path))
        return Tokenizer.from_gguf_metadata(meta) if meta.get("tokenizer.ggml.model") else None
    directory = path if path.is_dir() else path.parent
    try:
        return Tokenizer.from_hf_dir(directory)
    except CheckpointError:
        return None


def _load_safetensors(directory: Path, files: list[Path], source: Path, progress: bool) -> Checkpoint:
    from ..tokenizer import Tokenizer

    config = _read_config(directory)
    tensors: dict[str, np.ndarray] = {}
    bar = progress_bar(len(files), f"mapping {directory.name}", progress)
    for file in files:
        tensors.update(load_safetensors_file(file))
        bar.update(1)
    bar.close()
    try:
        tokenizer, notes = Tokenizer.from_hf_dir(directory, config), []
    except CheckpointError as e:  # weights without a tokenizer still run (token ids in, ids out)
        tokenizer, notes = None, [f"no tokenizer: {e}"]
    return Checkpoint(config, tensors, source, "safetensors", tokenizer, notes)


def _read_config(directory: Path) -> dict:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory} has no config.json; a safetensors checkpoint needs the Hugging Face "
                              f"config.json next to it")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_path} is not valid JSON ({e}); re-download it") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} is not a JSON object; re-download it")
    # Multimodal/wrapper configs keep the language model's settings in text_config.
    if "text_config" in config and "hidden_size" not in config and isinstance(config["text_config"], dict):
        config = {**config, **config["text_config"]}
    return config


__all__ = ["Checkpoint", "load_checkpoint", "load_tokenizer", "validate_tensors", "unexpected_tensors"]
