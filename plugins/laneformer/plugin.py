"""Registers the Laneformer architecture and its presets. Imports nothing heavy."""
from kog_core import ModelArchSpec, hookimpl


@hookimpl
def register_models(register):
    register(ModelArchSpec(name="laneformer", model_types=("laneformer_tp", "laneformer"),
                           factory="kog_laneformer.model:Laneformer",
                           description="Laneformer: per-lane residual streams, Delayed Tensor Parallelism"))
    from .presets import PRESETS
    for preset in PRESETS:
        register(preset)
