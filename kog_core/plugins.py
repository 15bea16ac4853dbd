"""Plugin discovery: one entry-point group (`kog`), pluggy hooks, a registry of what plugins
provide. Loading a plugin module is cheap by contract; a backend's heavy code is imported only
when that backend is selected (`Registry.create_backend`)."""
from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .errors import BackendUnavailable, PluginError
from .interfaces import (BackendSpec, CollectiveSpec, KernelBackend, ModelArchSpec, ModelPreset,
                         SamplerSpec, resolve_factory)

ENTRY_POINT_GROUP = "kog"


@dataclass
class PluginInfo:
    name: str                 # entry-point name
    module: str
    distribution: str
    version: str
    provides: list[str] = field(default_factory=list)
    error: str | None = None  # set when the plugin module failed to import


class Registry:
    """Everything the installed plugins registered."""

    def __init__(self):
        self.backends: dict[str, BackendSpec] = {}
        self.architectures: dict[str, ModelArchSpec] = {}
        self.presets: dict[str, ModelPreset] = {}
        self.collectives: dict[str, CollectiveSpec] = {}
        self.samplers: dict[str, SamplerSpec] = {}
        self.plugins: list[PluginInfo] = []

    def _add(self, table: dict, key: str, item: Any, plugin: PluginInfo, kind: str):
        if key in table:
            raise PluginError(f"plugin {plugin.name!r} registers {kind} {key!r}, already registered by another plugin")
        table[key] = item
        plugin.provides.append(f"{kind} {key}")

    def register_from(self, plugin: PluginInfo, item: Any):
        if isinstance(item, BackendSpec):
            self._add(self.backends, item.name, item, plugin, "backend")
        elif isinstance(item, ModelArchSpec):
            self._add(self.architectures, item.name, item, plugin, "architecture")
        elif isinstance(item, ModelPreset):
            self._add(self.presets, item.name, item, plugin, "model")
        elif isinstance(item, CollectiveSpec):
            self._add(self.collectives, item.name, item, plugin, "collective")
        elif isinstance(item, SamplerSpec):
            self._add(self.samplers, item.name, item, plugin, "sampler")
        else:
            raise PluginError(f"plugin {plugin.name!r} registered {type(item).__name__}, which is not a kog spec")

    # ---- lookups with one-line errors ----
    def backend_spec(self, name: str) -> BackendSpec:
        if name not in self.backends:
            raise PluginError(f"unknown backend {name!r}; available: {', '.join(sorted(self.backends)) or 'none'} "
                              f"(install the plugin that provides it, or see `kog plugins`)")
        return self.backends[name]

    def usable_backend_spec(self, name: str) -> BackendSpec:
        """The spec of a backend that can run on this machine (its probe passes)."""
        spec = self.backend_spec(name)
        reason = spec.probe() if spec.probe is not None else None
        if reason:
            raise BackendUnavailable(f"backend {name!r} cannot run here: {reason}; use --backend reference for the CPU")
        return spec

    def create_backend(self, name: str, **options) -> KernelBackend:
        spec = self.usable_backend_spec(name)
        try:
            cls = resolve_factory(spec.factory)
        except ImportError as e:
            raise BackendUnavailable(f"backend {name!r} failed to import ({e}); install its extra, e.g. pip install 'kog[{name.split('_')[0]}]'")
        backend = cls(**options)
        backend.name = name
        backend.capabilities = spec.capabilities
        return backend

    def architecture_for(self, model_type: str) -> ModelArchSpec:
        for spec in self.architectures.values():
            if model_type in spec.model_types:
                return spec
        known = sorted(t for s in self.architectures.values() for t in s.model_types)
        raise PluginError(f"no installed plugin handles model_type {model_type!r}; known: {', '.join(known)}")

    def collective(self, name: str, **options):
        if name not in self.collectives:
            raise PluginError(f"unknown collective {name!r}; available: {', '.join(sorted(self.collectives)) or 'none'}")
        return resolve_factory(self.collectives[name].factory)(**options)

    def sampler(self, name: str = "default"):
        if name not in self.samplers:
            raise PluginError(f"unknown sampler {name!r}; available: {', '.join(sorted(self.samplers)) or 'none'}")
        return resolve_factory(self.samplers[name].factory)()

    def default_backend(self) -> str:
        """The highest-priority backend whose probe passes (the CPU reference always does)."""
        usable = [s for s in self.backends.values() if s.probe is None or not s.probe()]
        if not usable:
            raise PluginError("no usable backend is installed; reinstall kog (it ships the CPU backend 'reference')")
        return max(usable, key=lambda s: (s.priority, s.name)).name


_REGISTRY: Registry | None = None


def _entry_points():
    return md.entry_points(group=ENTRY_POINT_GROUP)


def load_registry(refresh: bool = False) -> Registry:
    """Import every plugin module in the `kog` entry-point group and collect registrations."""
    global _REGISTRY
    if _REGISTRY is not None and not refresh:
        return _REGISTRY
    pm = pluggy.PluginManager("kog")
    pm.add_hookspecs(hookspecs)
    reg = Registry()
    seen = set()
    for ep in sorted(_entry_points(), key=lambda e: e.name):
        if ep.name in seen:  # the same distribution found twice on sys.path
            continue
        seen.add(ep.name)
        dist = getattr(ep, "dist", None)
        info = PluginInfo(ep.name, ep.value, dist.name if dist else "?", dist.version if dist else "?")
        reg.plugins.append(info)
        try:
            module = ep.load()
        except Exception as e:  # a broken third-party plugin must not take the others down
            info.error = f"{type(e).__name__}: {e}"
            continue
        pm.register(module, name=ep.name)
        for hook in ("register_backends", "register_models", "register_collectives", "register_samplers"):
            impls = [i for i in getattr(pm.hook, hook).get_hookimpls() if i.plugin_name == ep.name]
            for impl in impls:
                impl.function(lambda item, _info=info: reg.register_from(_info, item))
    _REGISTRY = reg
    return reg
