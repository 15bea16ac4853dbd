"""Build a model's decode program without loading weights (for `kog inspect`)."""
from __future__ import annotations

from .errors import KogError
from .interfaces import resolve_factory
from .plugins import load_registry


def inspect_program(model: str, context_length: int | None = None):
    reg = load_registry()
    if model in reg.presets:
        hf_config = dict(reg.presets[model].config)
    else:
        from .hub import resolve_model
        from .checkpoint import load_checkpoint
        hf_config = load_checkpoint(resolve_model(model, reg.presets), progress=False).config
    arch = resolve_factory(reg.architecture_for(str(hf_config.get("model_type"))).factory)(hf_config)
    ctx = context_length or min(arch.context_length, 8192)
    if ctx > arch.context_length:
        raise KogError(f"context length {ctx} exceeds the model's maximum of {arch.context_length}")
    return arch.lower(context_length=ctx, kv_dtype="bf16")
