"""Hook specifications: how a plugin tells kog what it provides.

A plugin is a module named in the `kog` entry-point group (in-tree plugins use exactly the
same group as third-party ones). The module defines one or more of the hooks below, marked
with `kog_core.hookimpl`. Each hook receives a `register` callable; call it once per thing
provided. Keep the module light: import CUDA/HIP/torch only inside the factories, which kog
calls only when that thing is selected.

    from kog_core import hookimpl, BackendSpec, BackendCapabilities

    @hookimpl
    def register_backends(register):
        register(BackendSpec(name="my_npu", factory="my_pkg.backend:MyBackend",
                             capabilities=BackendCapabilities(devices=("npu",), ...)))
"""
import pluggy

hookspec = pluggy.HookspecMarker("kog")


@hookspec
def register_backends(register):
    """Register kernel backends: call `register(BackendSpec(...))` for each.

    The spec carries the backend's frozen capabilities (checked before any weight is loaded)
    and a lazy factory ("module:Class" or a callable) that kog imports only when the backend
    is selected by name."""


@hookspec
def register_models(register):
    """Register model architectures and presets: call `register(ModelArchSpec(...))` for an
    architecture (matched against a checkpoint's `model_type`) and `register(ModelPreset(...))`
    for a named model such as `smollm2-135m`."""


@hookspec
def register_collectives(register):
    """Register collectives (cross-rank communication): `register(CollectiveSpec(...))`."""


@hookspec
def register_samplers(register):
    """Register token samplers: `register(SamplerSpec(...))`."""
