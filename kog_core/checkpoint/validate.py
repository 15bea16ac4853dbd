"""Check a checkpoint's tensors against what an architecture expects, before any weights move,
so a wrong or truncated checkpoint fails with one clear line instead of a shape error deep in
a kernel."""
from __future__ import annotations

from typing import Mapping

import ml_dtypes
import numpy as np

from ..errors import CheckpointError

# Weight dtypes kog computes with (after GGUF dequantization).
SUPPORTED_WEIGHT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))

# Tensors some checkpoints carry that no architecture needs (recomputed at lowering time).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def validate_tensors(tensors: Mapping[str, np.ndarray], expected: dict[str, tuple[int, ...]],
                     source: str) -> None:
    """Raise CheckpointError on the first missing tensor, wrong shape or unsupported dtype.

    Extra tensors the architecture does not use are allowed (e.g. an untied lm_head copy)."""
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"checkpoint {source} has no tensor {name} (expected shape {_fmt(shape)}); "
                                  f"is this checkpoint for a different model?")
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"checkpoint {source}: tensor {name} has shape {_fmt(tensor.shape)}, "
                                  f"expected {_fmt(shape)} from its config")
        if tensor.dtype not in SUPPORTED_WEIGHT_DTYPES:
            raise CheckpointError(f"checkpoint {source}: tensor {name} has dtype {tensor.dtype}, kog supports "
                                  f"float32, float16 and bfloat16 weights")


def unexpected_tensors(tensors: Mapping[str, np.ndarray], expected: Mapping[str, object]) -> list[str]:
    """Tensor names in the checkpoint that the architecture will not use (for a warning)."""
    return sorted(name for name in tensors
                  if name not in expected and not name.endswith(IGNORED_SUFFIXES))
