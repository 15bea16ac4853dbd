"""Plugin registration for the NVIDIA Hopper (sm_90a) monokernel backend. Imports nothing heavy."""
from __future__ import annotations

import ctypes
import ctypes.util

from kog_core import hookimpl
from kog_core.interfaces import BackendCapabilities, BackendSpec

OPS = frozenset({"embed", "rmsnorm", "matvec", "rope", "kv_append", "attention", "swiglu", "add", "copy",
                 "lane_mean", "lane_sum", "collective", "lane_residual", "sample"})

_ERRORS = {100: "CUDA_ERROR_NO_DEVICE", 35: "CUDA_ERROR_INSUFFICIENT_DRIVER", 3: "CUDA_ERROR_NOT_INITIALIZED",
           999: "CUDA_ERROR_UNKNOWN", 101: "CUDA_ERROR_INVALID_DEVICE"}


def probe() -> str | None:
    """None when an sm_90 GPU is usable here, else a one-line reason. Uses only ctypes."""
    names = ["libcuda.so.1", "libcuda.so"]
    found = ctypes.util.find_library("cuda")
    if found:
        names.insert(0, found)
    lib = None
    for n in names:
        try:
            lib = ctypes.CDLL(n)
            break
        except OSError:
            continue
    if lib is None:
        return "no NVIDIA GPU found (the CUDA driver libcuda.so is not installed)"
    rc = lib.cuInit(0)
    if rc != 0:
        return f"no NVIDIA GPU found (cuInit: {_ERRORS.get(rc, rc)})"
    n = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(n))
    if rc != 0 or n.value == 0:
        return "no NVIDIA GPU found (cuDeviceGetCount: 0 devices)"
    dev = ctypes.c_int(0)
    lib.cuDeviceGet(ctypes.byref(dev), 0)
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # COMPUTE_CAPABILITY_MAJOR
    lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    if (major.value, minor.value) != (9, 0):
        return f"GPU 0 has compute capability {major.value}.{minor.value}; nvidia_hopper needs 9.0 (H100/H200)"
    return None


CAPABILITIES = BackendCapabilities(devices=("cuda",), dtypes=frozenset({"bf16"}), ops=OPS, max_lanes=64,
                                   max_ranks=1, sampling_on_device=True, architectures=("sm_90a",),
                                   prefix_reuse=True)


@hookimpl
def register_backends(register):
    register(BackendSpec(
        name="nvidia_hopper",
        factory="kog_nvidia_hopper.backend:HopperBackend",
        capabilities=CAPABILITIES,
        description="Hopper (H100/H200) monokernel: the whole request in one cooperative launch (CUDA C++ via NVRTC)",
        priority=10,
        probe=probe,
    ))
