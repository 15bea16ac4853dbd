"""The decode program: construction checks, serialisation, byte counts."""
import pytest

from kog_core.program import DecodeProgram, new_program
from kog_moe_standard_tp.llama import Llama

from conftest import small_llama_config


def test_program_round_trips_through_json():
    prog = Llama(small_llama_config()).lower(32)
    again = DecodeProgram.from_dict(__import__("json").loads(prog.to_json()))
    assert again.ops == prog.ops and again.tensors == prog.tensors
    again.validate()


def test_undeclared_tensor_and_unknown_op_are_rejected():
    p = new_program("x", 1, 10, 8, 0)
    with pytest.raises(ValueError, match="undeclared"):
        p.add_op("add", ["a", "b"], ["c"])
    with pytest.raises(ValueError, match="unknown op"):
        p.add_op("conv2d", [], [])


def test_read_before_write_is_caught():
    p = new_program("x", 1, 10, 8, 0)
    p.add_tensor("a", (1, 4))
    p.add_tensor("logits", (1, 10), kind="output")
    p.add_op("add", ["a", "a"], ["logits"])
    with pytest.raises(ValueError, match="before any op writes it"):
        p.validate()


def test_bytes_per_token_match_the_peer_presets():
    from kog_moe_standard_tp.presets import BENCH_2B, LLAMA_32_1B
    # torch_peer.py: 2 * (head + layer weights incl. norms + one embedding row); final norm excluded there.
    assert abs(Llama(BENCH_2B.config).lower(1024).weight_bytes_per_token("bf16") / 1e9 - 3.80) < 0.01
    assert abs(Llama(LLAMA_32_1B.config).lower(1024).weight_bytes_per_token("bf16") / 1e9 - 2.47) < 0.01


def test_kv_bytes_grow_with_length_and_respect_the_window():
    prog = Llama(small_llama_config("mistral", sliding_window=4)).lower(32)
    att = [i for i, op in enumerate(prog.ops) if op.kind == "attention"]
    b2 = sum(prog.bytes_per_op(kv_len=2)[i] for i in att)
    b4 = sum(prog.bytes_per_op(kv_len=4)[i] for i in att)
    b30 = sum(prog.bytes_per_op(kv_len=30)[i] for i in att)
    assert b4 == 2 * b2 and b30 == b4


def test_format_lists_every_op():
    prog = Llama(small_llama_config()).lower(32)
    text = prog.format(kv_len=8)
    assert len(text.splitlines()) == len(prog.ops) + 2
    assert "bytes per token" in text
