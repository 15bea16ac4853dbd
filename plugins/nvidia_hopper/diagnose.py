"""Localise a GPU/reference mismatch: run both backends over a few tokens of a small model and
compare every buffer and KV cache the program declares (the GPU keeps each buffer's last value).

    python3 -m kog_nvidia_hopper.diagnose laneformer-replicate 3
"""
from __future__ import annotations

import sys

import numpy as np


def main(name="laneformer-replicate", n=3):
    import ml_dtypes
    sys.path.insert(0, "tests")
    from gpu.hopper_models import laneformer_model, model
    from kog_core.reference.backend import ReferenceBackend
    from kog_nvidia_hopper.backend import HopperBackend
    from kog_nvidia_hopper.cuda_util import check
    from kog_nvidia_hopper.plugin import CAPABILITIES
    arch, prog, w = laneformer_model(name) if name.startswith("laneformer") else model(name)
    ref = ReferenceBackend()
    ref.load(prog, w)
    hb = HopperBackend()
    hb.capabilities = CAPABILITIES
    hb.load(prog, w)
    toks = list(range(3, 3 + n))
    got, want = hb.logits(toks), ref.logits(toks)
    for i in range(n):
        print(f"pos {i}: logits rel err {np.linalg.norm(got[i] - want[i]) / np.linalg.norm(want[i]):.3g}")
    pending, in_smem = _splitk_pending(hb, n)
    for spec in prog.tensors.values():
        if spec.kind not in ("buffer", "kv", "output") or not spec.shape or spec.name not in hb.ptr:
            continue
        if spec.name in in_smem:
            print(f"{spec.name:28s} not written (KOG_HOPPER_SPLITK_DOWN keeps it in shared memory)")
            continue
        if spec.kind == "kv":
            raw = np.empty(spec.numel, np.uint16)
            check(hb.drv.cuMemcpyDtoH(raw.ctypes.data, hb.ptr[spec.name], raw.nbytes), "read")
            g = raw.view(ml_dtypes.bfloat16).astype(np.float32).reshape(spec.shape)[:, :, :n]
            r = ref.t[spec.name][:, :, :n]
            errs = [float(np.linalg.norm(g[:, :, p] - r[:, :, p]) / max(np.linalg.norm(r[:, :, p]), 1e-30)) for p in range(n)]
            print(f"{spec.name:28s} kv per position rel err {['%.2g' % e for e in errs]}")
        else:
            g = np.empty(spec.numel, np.float32)
            check(hb.drv.cuMemcpyDtoH(g.ctypes.data, hb.ptr[spec.name], g.nbytes), "read")
            r = ref.t[spec.name].reshape(-1)
            if spec.name in pending:  # x + the last split-K stage's sum, as the next reader sees it
                carried, acc = pending[spec.name]
                g = acc if carried else g + acc  # (SPLITK_CARRY: the accumulator holds x already)
            e = float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))
            lanes = ""
            if len(spec.shape) == 2 and spec.shape[0] > 1:
                gl, rl = g.reshape(spec.shape), r.reshape(spec.shape)
                lanes = " per lane " + str(['%.2g' % (np.linalg.norm(gl[l] - rl[l]) / max(np.linalg.norm(rl[l]), 1e-30)) for l in range(spec.shape[0])])
            print(f"{spec.name:28s} last-token rel err {e:.3g}{lanes}")


def _splitk_pending(hb, n):
    """KOG_HOPPER_SPLITK_DOWN builds: ({x: (carried, the accumulator the last fused stage left at the
    last position, in output order)}, {SwiGLU outputs the fused stages keep in shared memory});
    empty otherwise. carried (SPLITK_CARRY): the accumulator holds x plus the sum, else the sum."""
    from kog_nvidia_hopper import schedule as S
    from kog_nvidia_hopper.cuda_util import check
    fused = [st for st in hb.stages if st.f.get("_splitk")]
    if not fused:
        return {}, set()
    last = max(fused, key=lambda st: st.f["_acc"])
    perm = getattr(hb, "splitk_perm", False)
    D = int(last.f["MV_ACC_D"])
    Dp = S.acc_len(D, perm)  # (SPLITK_PERM: padded, and in the loaders' order)
    raw = np.empty(2 * Dp, np.int64)
    check(hb.drv.cuMemcpyDtoH(raw.ctypes.data, int(last.f["MV_ACC"]), raw.nbytes), "read")
    row = raw[((n - 1) & 1) * Dp:][:Dp][S.acc_ix(np.arange(D), perm)]
    x = last.segs[1]["out_name"]
    pending = {x: (bool(last.f.get("_carry_in")), (row / 2.0 ** 32).astype(np.float32))}
    return pending, {st.segs[0]["out_name"] for st in fused}


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["laneformer-replicate"]), *[int(a) for a in sys.argv[2:3]])
