"""What `HopperBackend.load` would build for a preset, on a machine without a GPU.

Device time is the scarce thing (one call in some sessions), so check a planned call's variants
here first: each one's KOG_HOPPER_* settings resolve as `load` resolves them (an impossible
combination stops with `load`'s own one-line error), and the kernel that `load` would compile
is compiled with NVRTC and its registers and spills reported.

    KOG_HOPPER_TAG_DOWN=1 python3 -m kog_nvidia_hopper.plan --preset bench-2b [--sms 132]
    python3 -m kog_nvidia_hopper.plan --preset laneformer-2b --variants "KOG_BASE=1 KOG_HOPPER_SLOTS=6 \
        KOG_HOPPER_SLOT_KB=26,KOG_HOPPER_SLOTS=6"   # devcall.sh's VARIANTS, one line each

The weights are zeros of the right shapes, so the plan is the real one but nothing is uploaded. The
device is an sm_90 with `--sms` SMs and 227 KB of opt-in shared memory a block (H100 and H200
alike; the ring's slots are sized from that).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from kog_core.errors import KogError
from kog_nvidia_hopper.backend import HopperBackend
from kog_nvidia_hopper.cuda_util import compile_cubin, ptxas_report, source
from kog_nvidia_hopper import schedule as S

HOPPER_MAX_SMEM_OPTIN = 232448  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN on H100 / H200


class _NoDevice:
    """Stands in for cuda.bindings.driver: every call succeeds and returns a placeholder address."""
    def __getattr__(self, name):
        return lambda *args: (0, 4096)


class _Planned(Exception):
    """Raised where load would load the compiled kernel onto the device: the plan is complete."""


class PlanningBackend(HopperBackend):
    """A HopperBackend that plans and compiles but never touches a device."""

    def __init__(self, sms: int = 132):  # not HopperBackend.__init__: that one opens the GPU
        from kog_nvidia_hopper.plugin import CAPABILITIES
        self.drv, self.nb, self.capabilities, self.allocs = _NoDevice(), sms, CAPABILITIES, []
        self.max_smem = HOPPER_MAX_SMEM_OPTIN
        self.ptxas: dict = {}

    def _load_kernel(self, variant: dict) -> None:
        _, log = compile_cubin(source(S.header(variant)))
        self.ptxas = ptxas_report(log)
        raise _Planned


def plan(program, sms: int = 132) -> dict:
    """The build `load` would make for `program` under the current KOG_HOPPER_* environment:
    stages, ring, compile-time settings and ptxas's registers and spills. Raises load's KogError
    (one line) for settings it refuses."""
    hb = PlanningBackend(sms)
    weights = {n: np.zeros(t.shape, np.float32) for n, t in program.tensors.items() if t.kind == "weight"}
    try:
        hb.load(program, weights)
    except _Planned:
        pass
    v = hb.variant
    return {"stages": len(hb.stages), "slots": v["NSLOTS"], "slot_bytes": v["SLOT_BYTES"],
            "smem": hb.smem, "variant": v, "ptxas": hb.ptxas}


def variant_settings(text: str) -> list[dict]:
    """devcall.sh's VARIANTS: variants apart by spaces, settings within one by commas."""
    out = []
    for v in text.split():
        d = {}
        for kv in filter(None, v.split(",")):
            k, eq, val = kv.partition("=")
            if not eq or not k:
                raise SystemExit(f"--variants: {kv!r} is not NAME=VALUE (e.g. KOG_HOPPER_SLOTS=6)")
            d[k] = val
        out.append(d)
    return out


def spills(p: dict) -> bool:
    return bool(p["ptxas"]["spill_stores"] or p["ptxas"]["spill_loads"])


def summary(name: str, p: dict) -> str:
    r = p["ptxas"]
    return (f"{name}: {p['stages']} stages, ring {p['slots']} x {p['slot_bytes'] // 1024} KB, "
            f"{p['smem']} bytes of shared memory; registers {r.get('registers')}, spill stores "
            f"{r['spill_stores']} / loads {r['spill_loads']} bytes (entry {r.get('entry_spill_stores', 0)})")


def main(argv=None):
    from kog_nvidia_hopper.bench import build
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", required=True, help="bench-2b, llama-3.2-1b, laneformer-2b, ...")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--sms", type=int, default=132, help="blocks (SMs) to plan for (default 132, the H100 SXM's and the H200's)")
    ap.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    ap.add_argument("--variants", default=None, metavar="VARIANTS",
                    help="plan each of these (devcall.sh's VARIANTS: spaces between variants, commas between "
                         "one variant's settings) over the current settings, one line each")
    a = ap.parse_args(argv)
    _, program = build(a.preset, a.context)
    if a.variants is not None:
        worst = 0
        for v in variant_settings(a.variants):
            name = ",".join(f"{k}={x}" for k, x in v.items())
            saved = {k: os.environ.get(k) for k in v}
            os.environ.update(v)
            try:
                p = plan(program, a.sms)
                print(summary(name, p))
                worst = max(worst, 2 if spills(p) else 0)
            except KogError as e:
                print(f"{name}: error: {e}")
                worst = max(worst, 1)
            finally:
                for k, old in saved.items():
                    if old is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = old
        sys.exit(worst)  # 1: some variant is refused, 2: some variant spills
    try:
        p = plan(program, a.sms)
    except KogError as e:
        raise SystemExit(f"error: {e}")
    if a.json:
        print(json.dumps(p, default=str))
        return
    flags = " ".join(f"{k}={v}" for k, v in sorted(p["variant"].items())
                     if not k.startswith("ATC_"))  # (the attention's shapes, schedule.attention_shape_consts, left out)
    print(summary(a.preset, p))
    print(flags)
    if spills(p):
        sys.exit(2)  # a spilling build is worth knowing about before a device call


if __name__ == "__main__":
    main()
