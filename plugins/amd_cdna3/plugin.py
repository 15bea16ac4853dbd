"""Registers the `amd_cdna3` backend name (MI300X). The HIP monokernel is not written yet: no AMD
GPU exists where kog is developed, and no issue covers it so far. Selecting it says exactly that
instead of pretending; see docs/status.md."""
from kog_core import BackendCapabilities, BackendSpec, hookimpl


def _probe() -> str | None:
    import importlib.util
    if importlib.util.find_spec("hip") is None:
        return "hip-python is not installed and the CDNA3 monokernel is not implemented yet (docs/status.md)"
    return "the CDNA3 (MI300X) monokernel is not implemented yet (docs/status.md)"


@hookimpl
def register_backends(register):
    register(BackendSpec(name="amd_cdna3", factory="kog_amd_cdna3.backend:CDNA3Backend",
                         capabilities=BackendCapabilities(devices=("hip",), dtypes=frozenset({"bf16"}),
                                                          architectures=("gfx942",)),
                         description="AMD MI300X monokernel (not implemented yet)", probe=_probe))
