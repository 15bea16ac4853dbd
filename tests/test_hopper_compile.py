"""CPU CI for nvidia_hopper: the kernel compiles for sm_90a through NVRTC (resource report
checked), the program lowering fuses what it should, and the backend says 'no GPU' cleanly."""
from __future__ import annotations

import pytest

from kog_core.errors import BackendUnavailable, KogError

# ptxas budget: __launch_bounds__(512, 1) caps registers at 65536 / 512 = 128 per thread.
MAX_REGISTERS = 128
# Spill bytes of the kernel entry as of 2026-12-02 (callee-save traffic of the four noinline
# stage functions, outside the weight-streaming loops). Regression guard; see docs/perf-notes-hopper.md.
MAX_SPILL_BYTES = 64


def _compile(**variant):
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python (NVRTC) is not installed")
    from kog_nvidia_hopper import schedule
    from kog_nvidia_hopper.cuda_util import compile_cubin, ptxas_report, source
    cubin, log = compile_cubin(source(schedule.header(variant)), use_cache=False)
    return cubin, log, ptxas_report(log)


@pytest.fixture(scope="module")
def compiled():
    return _compile()


def test_kernel_compiles_for_sm90a(compiled):
    cubin, log, rep = compiled
    assert cubin[:4] == b"\x7fELF"
    assert "sm_90a" in log
    assert rep["registers"] <= MAX_REGISTERS, rep


def test_spills_stay_under_budget(compiled):
    _, log, rep = compiled
    assert rep["spill_stores"] <= MAX_SPILL_BYTES and rep["spill_loads"] <= MAX_SPILL_BYTES, (rep, log[-2000:])


@pytest.mark.xfail(strict=True, reason="known: 56-60 bytes of callee-save spills at the noinline stage calls (perf notes)")
def test_zero_spills(compiled):
    _, _, rep = compiled
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0


def test_lowering_fuses_llama_layers():
    from kog_moe_standard_tp.llama import Llama
    from kog_moe_standard_tp.presets import BENCH_2B
    from kog_nvidia_hopper import schedule as S
    prog = Llama(BENCH_2B.config).lower(context_length=4096, kv_dtype="bf16")
    stages = S.lower(prog, 132)
    # per layer: qkv (+norm), attention (+rope, kv append), o_proj (+residual), gate/up/swiglu (+norm), down (+residual)
    assert len(stages) == 5 * 26 + 2
    assert [s.type for s in stages[:5]] == ["matvec", "attn", "matvec", "matvec", "matvec"]
    assert stages[0].f["MV_IN_MODE"] == 3           # embedding + rmsnorm folded into q/k/v
    assert len(stages[0].segs) == 3
    assert stages[3].segs[0]["SEG_W2"]              # gate/up paired, swiglu in the epilogue
    assert stages[1].f["AT_ROPE_Q"] == 1 and stages[1].f["AT_KNEW"]
    assert stages[-1].type == "sample"
    for st in stages:
        if st.type == "matvec":
            S.finalize_matvec(st, 132, prog.logits, lambda n: 1)
    assert stages[-2].f["MV_FLAGS"] == 1 | 2 | 4     # logits, skipped on prompt positions, argmax partials


def test_lowering_generic_ops_become_stages():
    from kog_moe_standard_tp.llama import Llama
    from kog_nvidia_hopper import schedule as S
    cfg = dict(model_type="qwen3", hidden_size=256, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=1,
               head_dim=64, intermediate_size=512, vocab_size=300, max_position_embeddings=256)
    stages = S.lower(Llama(cfg).lower(kv_dtype="bf16"), 132)
    assert [s.label for s in stages[:4]][1:3] == ["rmsnorm", "rmsnorm"]  # per-head q/k norms stay elementwise


def test_backend_reports_no_gpu_in_one_line():
    from kog_nvidia_hopper.plugin import probe
    reason = probe()
    if reason is None:
        pytest.skip("a usable GPU is present here")
    assert "\n" not in reason and reason
    from kog_core.plugins import load_registry
    with pytest.raises(BackendUnavailable) as e:
        load_registry(refresh=True).create_backend("nvidia_hopper")
    assert "\n" not in str(e.value)
    assert isinstance(e.value, KogError)


def test_weight_ring_variant_compiles_within_budget():
    """The opt-in build that streams weights through a shared-memory ring (bulk copy + mbarrier)."""
    import os
    from kog_nvidia_hopper import schedule
    os.environ["KOG_HOPPER_RING"] = "1"
    try:
        plan = schedule.ring_plan(61440, 232448)
    finally:
        del os.environ["KOG_HOPPER_RING"]
    assert plan["RING"] == 1 and plan["RING_SLOTS"] >= 2
    cubin, log, rep = _compile(**plan)
    assert cubin[:4] == b"\x7fELF"
    assert rep["registers"] <= MAX_REGISTERS, rep
    assert rep["spill_stores"] <= MAX_SPILL_BYTES and rep["spill_loads"] <= MAX_SPILL_BYTES, rep


def test_ring_tiles_fit_their_slot():
    from kog_nvidia_hopper import schedule
    for K in (64, 576, 1536, 2048, 3072, 8192):
        S = schedule.ring_split(K, schedule.SLOT_BYTES)
        assert 64 * K // S <= schedule.SLOT_BYTES and K // 8 >= S


def test_logits_rows_are_one_vocabulary_apart_for_laneformer_heads():
    """Logits mode stores position p's logits at p * V, also when the program has L lanes."""
    from kog_core.interfaces import resolve_factory
    from kog_core.plugins import load_registry
    from kog_nvidia_hopper import schedule as S
    from gpu.hopper_models import LANEFORMER_SMALL
    arch = resolve_factory(load_registry().architectures["laneformer"].factory)(LANEFORMER_SMALL["laneformer-replicate"])
    prog = arch.lower(context_length=64, kv_dtype="bf16")
    stages = S.lower(prog, 132)
    heads = [st for st in stages if st.type == "matvec" and any(sg["out_name"] == prog.logits for sg in st.segs)]
    assert len(heads) == 1
    S.finalize_matvec(heads[0], 132, prog.logits, lambda tiles: 0, logits_numel=prog.tensors[prog.logits].numel)
    assert heads[0].f["MV_OUT_STRIDE"] == prog.vocab_size and prog.lanes == 4
