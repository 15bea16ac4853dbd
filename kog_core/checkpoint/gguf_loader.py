"""GGUF files (llama.cpp): dequantized to numpy, renamed to Hugging Face tensor names, with an
HF-style config built from the metadata, so the rest of kog sees one checkpoint layout."""
from __future__ import annotations

import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError

# GGUF architecture -> (HF model_type, HF architectures entry)
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# Architectures whose Q/K weights llama.cpp's converter permutes for its RoPE pairing.
PERMUTED_QK_ARCHITECTURES = {"llama"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor (unknown names pass through unchanged)."""
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return gguf_name


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (HF rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Exact inverse of `permute_qk`: back to the row order HF's rotate-half RoPE expects."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class GGUFTensor:
    name: str
    tensor_type: Any            # gguf.GGMLQuantizationType
    shape: tuple[int, ...]      # GGUF order: fastest-varying axis first
    data: np.ndarray            # memory-mapped raw data, as gguf.GGUFReader lays it out


@dataclass
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of a scalar
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# Unquantized GGML tensor types -> numpy dtype (everything else is read as raw bytes)
_PLAIN_TENSOR_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "I8": np.dtype("i1"),
                        "I16": np.dtype("<i2"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8")}


def open_reader(path: Path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor table; tensor data stays memory-mapped.

    Our own parser rather than gguf.GGUFReader: that one builds a numpy view per array element,
    which takes seconds for a 50k-token vocabulary."""
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
    except FileNotFoundError:
        raise CheckpointError(f"GGUF file {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read GGUF file {path} ({e}); re-download it") from None
    try:
        return _parse(mapped)
    except (struct.error, ValueError, KeyError, IndexError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file ({e}); re-download it") from None


def _parse(mapped: np.ndarray) -> GGUFFile:
    import gguf
    buf = memoryview(mapped)  # zero-copy view for struct.unpack_from
    pos = 0

    def scalar(fmt):
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def string():
        nonlocal pos
        length = scalar("Q")
        text = bytes(buf[pos:pos + length]).decode("utf-8")
        pos += length
        return text

    def value(kind):
        nonlocal pos
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item_kind, count = scalar("I"), scalar("Q")
            if item_kind == _STRING:
                return [string() for _ in range(count)]
            if item_kind in _SCALAR_FORMATS:  # numbers: one vectorised read
                dtype = np.dtype("<" + _SCALAR_FORMATS[item_kind].replace("?", "b1"))
                items = np.frombuffer(buf, dtype=dtype, count=count, offset=pos)
                pos += count * dtype.itemsize
                return items.tolist()
            return [value(item_kind) for _ in range(count)]  # arrays of arrays
        return scalar(_SCALAR_FORMATS[kind])

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("bad magic, not GGUF")
    pos = 4
    version = scalar("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (big-endian or too new)")
    n_tensors, n_kv = scalar("Q"), scalar("Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(scalar("I"))

    table = []
    for _ in range(n_tensors):
        name = string()
        dims = tuple(scalar("Q") for _ in range(scalar("I")))
        table.append((name, gguf.GGMLQuantizationType(scalar("I")), dims, scalar("Q")))
    alignment = int(meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-pos // alignment) * alignment

    tensors = []
    for name, kind, dims, offset in table:
        numel = int(np.prod(dims, dtype=np.int64))
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        start = data_start + offset
        raw = mapped[start:start + numel // block_size * type_size]
        numpy_dims = tuple(reversed(dims))
        if kind.name in _PLAIN_TENSOR_DTYPES:
            data = raw.view(_PLAIN_TENSOR_DTYPES[kind.name]).reshape(numpy_dims)
        else:  # quantized and BF16: bytes, one row per leading index, as GGUFReader gives them
            data = raw.reshape(*numpy_dims[:-1], numpy_dims[-1] // block_size * type_size)
        tensors.append(GGUFTensor(name, kind, dims, data))
    return GGUFFile(meta, tensors)


def metadata(reader: GGUFFile) -> dict[str, Any]:
    """Every metadata key -> its Python value (strings, numbers, lists)."""
    return reader.metadata


def gguf_config(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], source: Path) -> dict:
    """An HF-style config.json dict from GGUF metadata (tensor_shapes: GGUF names, numpy order)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{source}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    model_type, hf_arch = GGUF_ARCHITECTURES[arch]

    def get(key, default=None, required=False):
        value = meta.get(f"{arch}.{key}", default)
        if value is None and required:
            raise CheckpointError(f"{source}: GGUF metadata has no {arch}.{key}; the file is incomplete")
        return value

    hidden = int(get("embedding_length", required=True))
    n_heads = int(get("attention.head_count", required=True))
    n_kv_heads = int(get("attention.head_count_kv", n_heads))
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // n_heads
    vocab = (get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
             or tensor_shapes.get("token_embd.weight", (None,))[0])
    if not vocab:
        raise CheckpointError(f"{source}: GGUF file has no {arch}.vocab_size, token list or token_embd.weight")

    config = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": int(head_dim),
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "vocab_size": int(vocab),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
        "torch_dtype": "float32",
    }
    scaling_type = get("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        config["rope_scaling"] = {"rope_type": scaling_type, "type": scaling_type,
                                  "factor": float(get("rope.scaling.factor", 1.0))}
        original = get("rope.scaling.original_context_length")
        if original:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)

    for hf_key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                             ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if meta.get(gguf_key) is not None:
            config[hf_key] = int(meta[gguf_key])
    eos_ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                       "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    eos_ids = list(dict.fromkeys(eos_ids))  # de-duplicate, keep order
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return config


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUF tensor as numpy in numpy axis order: F32/F16/BF16 zero-copy, quantized -> float32."""
    import gguf
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest axis first
    kind = tensor.tensor_type
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(tensor.data).reshape(shape)
    if kind == gguf.GGMLQuantizationType.BF16:
        import ml_dtypes
        return np.asarray(tensor.data).view(ml_dtypes.bfloat16).reshape(shape)
    try:
        values = gguf.quants.dequantize(tensor.data, kind)
    except NotImplementedError:
        raise CheckpointError(f"GGUF tensor {tensor.name} uses quantization {kind.name}, which the "
                              f"installed gguf package cannot dequantize; use a Q4_0/Q4_1/Q5/Q8_0/K-quant "
                              f"or F16 file") from None
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def load_gguf(path: Path, progress: bool = False):
    """(config, tensors with HF names, tokenizer or None) of one GGUF file."""
    from ..tokenizer import Tokenizer

    reader = open_reader(path)
    meta = metadata(reader)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    config = gguf_config(meta, shapes, path)
    arch = meta["general.architecture"]
    unpermute = arch in PERMUTED_QK_ARCHITECTURES

    tensors: dict[str, np.ndarray] = {}
    bar = progress_bar(len(reader.tensors), f"dequantizing {path.name}", progress)
    for tensor in reader.tensors:
        array = dequantize_tensor(tensor)
        name = hf_tensor_name(tensor.name)
        if unpermute and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            array = unpermute_qk(array, config["num_attention_heads"])
        elif unpermute and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            array = unpermute_qk(array, config["num_key_value_heads"])
        tensors[name] = array
        bar.update(1)
    bar.close()

    tokenizer = Tokenizer.from_gguf_metadata(meta) if meta.get("tokenizer.ggml.model") else None
    return config, tensors, tokenizer


class _NoBar:
    def update(self, n=1):
        pass

    def close(self):
        pass


def progress_bar(total: int, desc: str, progress: bool):
    """A tqdm bar on stderr when asked for and stderr is a terminal (quiet in tests and pipes)."""
    if not progress or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)
