"""Safetensors files, read lazily: we parse the header ourselves and memory-map each tensor,
so a multi-GB checkpoint "loads" instantly and pages in only what the backend touches."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import CheckpointError

# safetensors dtype tag -> numpy dtype (little-endian, as the format specifies)
SAFETENSORS_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "BOOL": np.dtype("bool"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own limit


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset where tensor data starts."""
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path} is not a safetensors file (too short); re-download it")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > _MAX_HEADER_BYTES:
                raise CheckpointError(f"{path} is not a safetensors file (bad header length); re-download it")
            header_bytes = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    if len(header_bytes) != header_len:
        raise CheckpointError(f"{path} is truncated (header cut short); re-download it")
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path} has a corrupt safetensors header; re-download it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header; re-download it")
    return header, 8 + header_len


def load_safetensors_file(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one file, as read-only arrays backed by a memory map (no data is read)."""
    path = Path(path)
    header, data_start = read_header(path)
    header.pop("__metadata__", None)
    file_size = path.stat().st_size
    data_size = file_size - data_start
    # One map for the whole file; each tensor is a view into it (views of a memmap stay lazy).
    mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_size,)) \
        if data_size > 0 else np.zeros(0, np.uint8)
    tensors = {}
    for name, info in header.items():
        try:
            dtype_tag, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name} has a corrupt header entry; re-download it") from None
        dtype = SAFETENSORS_DTYPES.get(dtype_tag)
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has dtype {dtype_tag}, which kog does not support "
                                  f"(supported: {', '.join(SAFETENSORS_DTYPES)})")
        numel = int(np.prod(shape, dtype=np.int64))
        if end - begin != numel * dtype.itemsize or end > data_size or begin < 0:
            raise CheckpointError(f"{path}: tensor {name} lies outside the file or has the wrong size "
                                  f"(the file is truncated or corrupt); re-download it")
        tensors[name] = mapped[begin:end].view(dtype).reshape(shape)
    return tensors


def shard_files(directory: Path) -> list[Path]:
    """The safetensors files of a Hugging Face model directory, in a stable order."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise CheckpointError(f"{index} is corrupt (no weight_map); re-download it") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{directory} is missing shard(s) {', '.join(missing)} listed in "
                                  f"{index.name}; finish the download")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(directory.glob("*.safetensors"))
