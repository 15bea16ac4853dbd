"""Registers the Llama-family architecture and its presets. Imports nothing heavy."""
from kog_core import ModelArchSpec, hookimpl


@hookimpl
def register_models(register):
    register(ModelArchSpec(name="llama", model_types=("llama", "qwen2", "qwen3", "mistral"),
                           factory="kog_moe_standard_tp.llama:Llama",
                           description="Llama 2/3, SmolLM2, Qwen2/Qwen3 dense (standard TP)"))
    from .presets import PRESETS
    for preset in PRESETS:
        register(preset)
