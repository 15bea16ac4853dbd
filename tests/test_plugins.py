"""Plugin discovery, lazy loading, selection errors, capabilities, and a real out-of-tree plugin."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kog_core.errors import CapabilityError, PluginError
from kog_core.interfaces import BackendCapabilities
from kog_core.plugins import load_registry
from kog_moe_standard_tp.llama import Llama

from conftest import small_llama_config

FIXTURE = Path(__file__).parent / "fixtures" / "kog_example_plugin"


def test_in_tree_plugins_register_through_entry_points():
    reg = load_registry(refresh=True)
    names = {p.name for p in reg.plugins}
    assert {"reference", "moe_standard_tp", "laneformer", "kccl", "nvidia_hopper", "amd_cdna3"} <= names
    assert "reference" in reg.backends and "llama" in reg.architectures and "default" in reg.samplers
    assert {"smollm2-135m", "bench-2b", "llama-3.2-1b"} <= set(reg.presets)


def test_unknown_backend_lists_the_available_ones():
    with pytest.raises(PluginError, match=r"unknown backend 'nope'; available: .*reference"):
        load_registry().create_backend("nope")


def test_loading_the_registry_imports_no_gpu_stack():
    code = ("import sys; from kog_core.plugins import load_registry; load_registry(); "
            "heavy = [m for m in ('cuda', 'cuda.bindings', 'hip', 'torch', 'kog_nvidia_hopper.backend') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_capabilities_are_frozen_and_checked():
    caps = BackendCapabilities(ops=frozenset({"embed"}), max_lanes=1)
    with pytest.raises(Exception):
        caps.max_lanes = 8
    problems = caps.check(Llama(small_llama_config()).lower(16))
    assert problems and "not implemented" in problems[0]


@pytest.fixture(scope="module")
def example_plugin_site(tmp_path_factory):
    """Install the out-of-tree plugin package (as a third party would) into a private folder."""
    target = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(target), str(FIXTURE)], capture_output=True, text=True)
    if r.returncode:
        pytest.fail("pip could not install the example plugin: " + r.stderr[-2000:])
    return target


def _kog(args, site, **kw):
    env = dict(os.environ, PYTHONPATH=str(site) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "kog_core.cli", *args], capture_output=True, text=True, env=env, **kw)


def test_out_of_tree_plugin_is_discovered_listed_and_runs(example_plugin_site):
    r = _kog(["plugins"], example_plugin_site)
    assert r.returncode == 0, r.stderr
    assert "example (kog-example-plugin 0.3.1" in r.stdout and "backend example_cpu" in r.stdout
    assert "example_npu" in r.stdout and "unavailable: no Example NPU found" in r.stdout
    r = _kog(["run", "--model", "smollm2-135m", "--random-weights", "--backend", "example_cpu",
              "--prompt-ids", "1,2,3", "-n", "3", "--json"], example_plugin_site)
    assert r.returncode == 0, r.stderr
    import json
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 3


def test_backend_with_missing_hardware_says_so(example_plugin_site):
    r = _kog(["run", "--model", "smollm2-135m", "--random-weights", "--backend", "example_npu", "--prompt-ids", "1"],
             example_plugin_site)
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: backend 'example_npu' cannot run here: no Example NPU found (/dev/example0 is "
                                "missing); use --backend reference for the CPU")


def test_selecting_a_backend_imports_only_that_backend(example_plugin_site):
    code = ("import sys; from kog_core.plugins import load_registry; r = load_registry(); "
            "r.create_backend('reference'); print('kog_example_plugin.backend' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(example_plugin_site))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.stdout.strip() == "False", r.stderr


def test_unsupported_program_fails_before_weights_load(example_plugin_site):
    r = _kog(["run", "--model", "laneformer-2b", "--random-weights", "--backend", "example_cpu", "--prompt-ids", "1"],
             example_plugin_site, timeout=120)
    assert r.returncode == 2
    assert "cannot run laneformer-2b" in r.stderr and "not implemented" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_capabilities_are_checked_before_any_weight_is_read(tmp_path, monkeypatch):
    import json

    from safetensors.numpy import save_file

    import kog_core.checkpoint as checkpoint
    from kog_core import Engine
    from kog_core.interfaces import BackendSpec
    cfg = small_llama_config()
    save_file(Llama(cfg).random_weights(0), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    reg = load_registry()
    monkeypatch.setitem(reg.backends, "matvec_only", BackendSpec(
        name="matvec_only", factory="kog_core.reference.backend:ReferenceBackend",
        capabilities=BackendCapabilities(ops=frozenset({"matvec"}))))
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(CapabilityError, match="backend 'matvec_only' cannot run .*attention.* not implemented"):
        Engine.load(model=str(tmp_path), backend="matvec_only")
