"""Checkpoint loading: safetensors (lazy, sharded), GGUF (dequantize, rename, un-permute), validation."""
import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kog_core.checkpoint import Checkpoint, load_checkpoint, unexpected_tensors, validate_tensors
from kog_core.checkpoint.gguf_loader import hf_tensor_name, permute_qk, unpermute_qk
from kog_core.errors import CheckpointError

DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_NUMPY_TO_TAG = {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32",
                 np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}


def write_safetensors(path: Path, tensors: dict, dtype_override: dict | None = None) -> None:
    """A minimal safetensors writer (the safetensors package cannot write bfloat16 from numpy)."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        tag = (dtype_override or {}).get(name) or _NUMPY_TO_TAG[array.dtype]
        header[name] = {"dtype": tag, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


TINY_CONFIG = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
               "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 32, "rms_norm_eps": 1e-5,
               "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": True,
               "bos_token_id": 1, "eos_token_id": 2}


def tiny_tensors(rng) -> dict:
    return {"model.embed_tokens.weight": rng.standard_normal((32, 8)).astype(ml_dtypes.bfloat16),
            "model.norm.weight": np.ones(8, np.float32),
            "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8)).astype(np.float16),
            "positions": np.arange(5, dtype=np.int64)}


# ----------------------------------------------------------------------------- safetensors

def test_single_file_directory_loads_lazily_with_exact_values(tmp_path):
    rng = np.random.default_rng(0)
    tensors = tiny_tensors(rng)
    write_safetensors(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))

    ck = load_checkpoint(tmp_path, progress=False)
    assert isinstance(ck, Checkpoint) and ck.format == "safetensors" and ck.path == tmp_path
    assert ck.config["hidden_size"] == 8
    assert set(ck.tensors) == set(tensors)
    for name, array in tensors.items():
        assert ck.tensors[name].dtype == array.dtype and ck.tensors[name].shape == array.shape
        np.testing.assert_array_equal(ck.tensors[name], array)
    # memory-mapped, read-only: nothing was copied into RAM
    embed = ck.tensors["model.embed_tokens.weight"]
    assert not embed.flags.writeable
    assert isinstance(embed.base, np.memmap) or isinstance(embed.base.base, np.memmap)
    assert ck.tokenizer is None and any("tokenizer" in note for note in ck.notes)


def test_matches_reference_safetensors_writer(tmp_path):
    from safetensors.numpy import save_file
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(6, dtype=np.float16),
              "c": np.array([[1, 2]], dtype=np.int32)}
    save_file(arrays, str(tmp_path / "w.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ck = load_checkpoint(tmp_path / "w.safetensors", progress=False)  # a file next to its config.json
    for name, array in arrays.items():
        np.testing.assert_array_equal(ck.tensors[name], array)
        assert ck.tensors[name].dtype == array.dtype


def test_sharded_checkpoint_with_index(tmp_path):
    rng = np.random.default_rng(1)
    tensors = tiny_tensors(rng)
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        write_safetensors(tmp_path / shard, {n: tensors[n] for n in shard_names})
        weight_map.update({n: shard for n in shard_names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    ck = load_checkpoint(tmp_path, progress=False)
    assert set(ck.tensors) == set(names)
    np.testing.assert_array_equal(ck.tensors["positions"], tensors["positions"])

    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing shard.*model-00002-of-00002"):
        load_checkpoint(tmp_path, progress=False)


def test_directory_tokenizer_is_loaded(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers
    vocab = {"<s>": 0, "</s>": 1, "<|eot|>": 2, "hi": 3, "[UNK]": 4}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": "{{ bos_token }}x"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    write_safetensors(tmp_path / "model.safetensors", {"model.norm.weight": np.ones(8, np.float32)})
    ck = load_checkpoint(tmp_path, progress=False)
    assert ck.tokenizer is not None
    assert ck.tokenizer.bos_token_id == 0 and ck.tokenizer.eos_token_ids == {1, 2}
    assert ck.tokenizer.apply_chat_template([]) == "<s>x"


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:-10]), "truncated or corrupt"),
    (lambda p: p.write_bytes(p.read_bytes()[:4]), "not a safetensors file"),
    (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{{{{"), "corrupt safetensors header"),
])
def test_corrupt_safetensors_is_one_line_error(tmp_path, damage, message):
    write_safetensors(tmp_path / "model.safetensors", {"w": np.ones((4, 4), np.float32)})
    (tmp_path / "config.json").write_text("{}")
    damage(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(tmp_path, progress=False)
    assert "\n" not in str(info.value) and "model.safetensors" in str(info.value)


def test_unsupported_safetensors_dtype(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"w": np.ones(4, np.float32)}, dtype_override={"w": "C64"})
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="dtype C64"):
        load_checkpoint(tmp_path, progress=False)


def test_missing_paths_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", progress=False)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(tmp_path, progress=False)
    write_safetensors(tmp_path / "model.safetensors", {"w": np.ones(4, np.float32)})
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path, progress=False)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(tmp_path, progress=False)
    bad_gguf = tmp_path / "x.gguf"
    bad_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="x.gguf"):
        load_checkpoint(bad_gguf, progress=False)


# ----------------------------------------------------------------------------- validation

def test_validate_tensors_messages():
    tensors = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, ml_dtypes.bfloat16),
               "i": np.zeros(4, np.int64), "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(2, np.float32)}
    validate_tensors(tensors, {"a": (2, 3), "b": (4,)}, "ck")  # extra tensors are fine
    assert unexpected_tensors(tensors, {"a": (2, 3), "b": (4,)}) == ["i"]

    with pytest.raises(CheckpointError) as info:
        validate_tensors(tensors, {"c": (5, 6)}, "ck")
    assert str(info.value) == ("checkpoint ck has no tensor c (expected shape [5, 6]); "
                               "is this checkpoint for a different model?")
    with pytest.raises(CheckpointError) as info:
        validate_tensors(tensors, {"a": (3, 2)}, "ck")
    assert str(info.value) == "checkpoint ck: tensor a has shape [2, 3], expected [3, 2] from its config"
    with pytest.raises(CheckpointError, match="tensor i has dtype int64"):
        validate_tensors(tensors, {"i": (4,)}, "ck")


# ----------------------------------------------------------------------------- GGUF

def test_gguf_names_map_to_hf():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_norm.weight") == "model.layers.12.input_layernorm.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_tensor_name("rope_freqs.weight") == "rope_freqs.weight"  # unknown: unchanged


def llama_cpp_permute(weights, n_head, n_head_kv=None):
    """Verbatim from llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


@pytest.mark.parametrize("n_head, head_dim, cols", [(9, 64, 576), (3, 64, 576), (4, 8, 5), (2, 4, None)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, cols):
    rng = np.random.default_rng(2)
    shape = (n_head * head_dim,) + ((cols,) if cols else ())
    w = rng.standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    np.testing.assert_array_equal(permute_qk(w, n_head), permuted)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)
    # what the permutation means: within a head, GGUF row 2j is HF row j, row 2j+1 is HF row j + head_dim/2
    half = head_dim // 2
    np.testing.assert_array_equal(permuted[0:head_dim:2], w[:half])
    np.testing.assert_array_equal(permuted[1:head_dim:2], w[half:head_dim])


def write_tiny_gguf(path: Path, arch: str, hf: dict, tied: bool = True, with_tokenizer: bool = True):
    """A 1-layer GGUF as llama.cpp's converter would write it (Q/K permuted for llama)."""
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(16)
    if with_tokenizer:
        tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(33, 127)]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
        writer.add_token_merges([])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    n_head, n_kv = 4, 2
    for name, array in hf.items():
        if tied and name == "lm_head.weight":
            continue
        gguf_name = {v: k for k, v in _HF_TO_GGUF_NAMES.items()}.get(name, name)
        gguf_name = gguf_name.replace("model.layers.0.", "blk.0.")
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, n_head, n_head)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, n_head, n_kv)
        if name == "model.embed_tokens.weight":  # quantized, like the demo model's Q8_0 embedding
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_HF_TO_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight", "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
    "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
}


def tiny_hf_weights(rng, vocab=97) -> dict:
    shapes = {"model.embed_tokens.weight": (vocab, 64), "model.norm.weight": (64,),
              "model.layers.0.input_layernorm.weight": (64,), "model.layers.0.self_attn.q_proj.weight": (64, 64),
              "model.layers.0.self_attn.k_proj.weight": (32, 64), "model.layers.0.self_attn.v_proj.weight": (32, 64),
              "model.layers.0.self_attn.o_proj.weight": (64, 64),
              "model.layers.0.post_attention_layernorm.weight": (64,),
              "model.layers.0.mlp.gate_proj.weight": (96, 64), "model.layers.0.mlp.up_proj.weight": (96, 64),
              "model.layers.0.mlp.down_proj.weight": (64, 96), "lm_head.weight": (vocab, 64)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


@pytest.mark.parametrize("arch, tied", [("llama", True), ("llama", False), ("qwen2", True)])
def test_tiny_gguf_round_trip(tmp_path, arch, tied):
    rng = np.random.default_rng(3)
    hf = tiny_hf_weights(rng)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch, hf, tied=tied)

    ck = load_checkpoint(path, progress=False)
    assert ck.format == "gguf" and ck.path == path
    c = ck.config
    assert c["model_type"] == arch
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (1, 64, 96)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 16)
    assert (c["rope_theta"], c["max_position_embeddings"], c["vocab_size"]) == (50000.0, 128, 97)
    assert c["tie_word_embeddings"] is tied
    assert c["rms_norm_eps"] == pytest.approx(1e-6)
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)

    expected = set(hf) - ({"lm_head.weight"} if tied else set())
    assert set(ck.tensors) == expected
    for name in expected:
        got = ck.tensors[name]
        assert got.shape == hf[name].shape, name
        if name == "model.embed_tokens.weight":  # Q8_0: close, not exact
            np.testing.assert_allclose(got, hf[name], atol=0.05)
        else:  # Q/K are un-permuted back to HF order exactly
            np.testing.assert_array_equal(got, hf[name], err_msg=name)

    tok = ck.tokenizer
    assert tok is not None and tok.bos_token_id == 1 and tok.eos_token_ids == {2}
    assert tok.encode("<|im_start|>ab") == [1, tok.token_to_id("a"), tok.token_to_id("b")]


def test_gguf_without_tokenizer_and_unsupported_arch(tmp_path):
    import gguf
    hf = tiny_hf_weights(np.random.default_rng(4))
    write_tiny_gguf(tmp_path / "a.gguf", "llama", hf, with_tokenizer=False)
    ck = load_checkpoint(tmp_path / "a.gguf", progress=False)
    assert ck.tokenizer is None and ck.config["vocab_size"] == 97

    writer = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "mamba")
    writer.add_tensor("x.weight", np.ones(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="architecture 'mamba' is not supported"):
        load_checkpoint(tmp_path / "b.gguf", progress=False)


def test_directory_with_a_single_gguf(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "llama", tiny_hf_weights(np.random.default_rng(5)))
    assert load_checkpoint(tmp_path, progress=False).format == "gguf"


# ----------------------------------------------------------------------------- the real demo model

def demo_gguf_path() -> Path | None:
    """$KOG_TEST_GGUF, else the file `kog pull smollm2-135m` leaves in the kog cache."""
    if os.environ.get("KOG_TEST_GGUF"):
        return Path(os.environ["KOG_TEST_GGUF"])
    from kog_core.hub import cache_dir
    candidate = cache_dir() / "models" / "smollm2-135m" / DEMO_GGUF_NAME
    return candidate if candidate.is_file() else None


@pytest.fixture(scope="module")
def demo_checkpoint():
    path = demo_gguf_path()
    if path is None or not path.is_file():
        pytest.skip("demo GGUF not found: set KOG_TEST_GGUF or run `kog pull smollm2-135m`")
    return load_checkpoint(path, progress=False)


def test_demo_gguf_config_and_shapes(demo_checkpoint):
    c = demo_checkpoint.config
    assert c["model_type"] == "llama"
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]) == \
        (30, 576, 9, 3)
    assert (c["head_dim"], c["intermediate_size"], c["vocab_size"], c["rope_theta"]) == (64, 1536, 49152, 100000.0)
    assert c["tie_word_embeddings"] is True and "lm_head.weight" not in demo_checkpoint.tensors
    t = demo_checkpoint.tensors
    assert len(t) == 2 + 30 * 9
    assert t["model.embed_tokens.weight"].shape == (49152, 576)
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert t["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert t["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(np.isfinite(a).all() for a in (t["model.embed_tokens.weight"], t["model.norm.weight"]))


def test_gguf_parser_matches_gguf_reader(tmp_path):
    import gguf
    from kog_core.checkpoint.gguf_loader import open_reader
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", tiny_hf_weights(np.random.default_rng(6)))
    ours, reference = open_reader(path), gguf.GGUFReader(path)
    expected_meta = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected_meta
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.data.dtype == theirs.data.dtype
        np.testing.assert_array_equal(mine.data, theirs.data)


def test_truncated_gguf_is_one_line_error(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", tiny_hf_weights(np.random.default_rng(7)))
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="tiny.gguf.*re-download"):
        load_checkpoint(path, progress=False)


def test_load_tokenizer_only(tmp_path):
    from kog_core.checkpoint import load_tokenizer
    write_tiny_gguf(tmp_path / "m.gguf", "llama", tiny_hf_weights(np.random.default_rng(8)))
    for target in (tmp_path / "m.gguf", tmp_path):
        tok = load_tokenizer(target)
        assert tok is not None and tok.bos_token_id == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_tokenizer(empty) is None
