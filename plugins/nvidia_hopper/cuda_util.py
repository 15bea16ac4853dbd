"""Thin helpers over cuda.bindings (driver + NVRTC): errors, compile with an on-disk cubin cache."""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from kog_core.errors import BackendUnavailable, KogError

KERNEL_DIR = Path(__file__).parent / "kernels"
ARCH = "sm_90a"
NVRTC_OPTIONS = ("--gpu-architecture=sm_90a", "-default-device", "-lineinfo", "--std=c++17",
                 "--ptxas-options=-v", "--extra-device-vectorization")


def _drv():
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover
        raise BackendUnavailable(f"cuda-python is not installed ({e}); pip install 'kog[nvidia]'")
    return driver


def check(res, what="CUDA call"):
    """cuda.bindings returns (err, *values); raise a one-line KogError on failure."""
    if isinstance(res, tuple):
        err, vals = res[0], res[1:]
    else:
        err, vals = res, ()
    code = int(err)
    if code != 0:
        name = getattr(err, "name", str(err))
        if "OUT_OF_MEMORY" in name:
            raise KogError(f"out of GPU memory during {what} ({name})")
        raise KogError(f"{what} failed: {name}")
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


def kernel_source(name: str, kernel_dir: Path = KERNEL_DIR) -> str:
    """A .cu file of kernels/ with its `#include "x.cuh"` lines replaced by those files (NVRTC
    gets one self-contained source, and the cubin cache key covers the headers too). kernel_dir:
    another copy of kernels/ (sass_report --same-as: a git revision's)."""
    def expand(m):
        return (kernel_dir / m.group(1)).read_text()
    return re.sub(r'^#include "([\w.]+\.cuh)".*$', expand, (kernel_dir / name).read_text(), flags=re.M)


def source(header: str, kernel_dir: Path = KERNEL_DIR) -> str:
    return header + kernel_source("decode.cu", kernel_dir)


def cache_dir() -> Path:
    d = Path(os.environ.get("KOG_CACHE", Path.home() / ".cache" / "kog")) / "nvidia_hopper"
    d.mkdir(parents=True, exist_ok=True)
    return d


def compile_cubin(src: str, options=NVRTC_OPTIONS, name="decode.cu", use_cache=True) -> tuple[bytes, str]:
    """Compile CUDA C++ to an sm_90a cubin with NVRTC. Returns (cubin, ptxas log)."""
    from cuda.bindings import nvrtc
    ver = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    key = hashlib.sha256((src + "\0" + " ".join(options) + f"\0{ver}").encode()).hexdigest()[:32]
    path = cache_dir() / f"{key}.cubin"
    logp = cache_dir() / f"{key}.log"
    if use_cache and path.exists() and logp.exists():
        return path.read_bytes(), logp.read_text()
    prog = check(nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    opts = [o.encode() for o in options]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    n = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    log = log.decode(errors="replace").rstrip("\x00 ")
    if int(err) != 0:
        raise KogError("NVRTC failed to compile the nvidia_hopper kernel: " + " | ".join(log.splitlines()[:20]))
    size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    cubin = b" " * size
    check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    nvrtc.nvrtcDestroyProgram(prog)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin)
    os.replace(tmp, path)
    logp.write_text(log)
    return cubin, log


def ptxas_report(log: str, entry: str = "kog_decode") -> dict:
    """Registers and stack frame of `entry`, and spill bytes summed over every function in the
    ptxas -v log (the entry and the noinline device functions it calls: a callee's spills are the
    kernel's too), with the entry's own as entry_spill_stores / entry_spill_loads."""
    out = {"spill_stores": 0, "spill_loads": 0}
    for name, stack, st, ld in re.findall(
            r"Function properties for (\S+)\s*\n\s*ptxas\s*\.\s*(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log):
        out["spill_stores"] += int(st)
        out["spill_loads"] += int(ld)
        if name == entry:
            out.update(stack=int(stack), entry_spill_stores=int(st), entry_spill_loads=int(ld))
    m = re.search(rf"Compiling entry function '{entry}'.*?Used (\d+) registers", log, re.S)
    if m:
        out["registers"] = int(m.group(1))
    return out
