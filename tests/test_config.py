"""Config: TOML + pydantic, unknown keys are errors with key paths, CLI flags override the file."""
import subprocess
import sys
from pathlib import Path

import pytest

from kog_core.config import load_config, read_toml, validate_dict
from kog_core.errors import ConfigError

EXAMPLE = Path(__file__).parent.parent / "docs" / "example-deploy.toml"


def test_example_config_in_docs_is_valid():
    cfg, problems = validate_dict(read_toml(EXAMPLE), str(EXAMPLE))
    assert problems == [] and cfg.model.name


def test_every_problem_is_reported_with_its_key_path(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[model]\nname = "smollm2-135m"\ncontxt_length = 10\n[sampling]\ntemperature = -1\n'
                 '[server]\nport = "http"\n[bogus]\nx = 1\n')
    _, problems = validate_dict(read_toml(f), "bad.toml")
    text = "\n".join(problems)
    assert "bad.toml: model.contxt_length: unknown key" in text
    assert "bad.toml: sampling.temperature: Input should be greater than or equal to 0" in text
    assert "bad.toml: server.port:" in text
    assert "bad.toml: bogus: unknown key" in text
    assert len(problems) == 4


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\nname = "bench-2b"\ncontext_length = 512\n[backend]\nname = "reference"\n')
    cfg = load_config(f, {"model": {"name": "smollm2-135m", "context_length": None}})
    assert cfg.model.name == "smollm2-135m" and cfg.model.context_length == 512 and cfg.backend.name == "reference"


@pytest.mark.parametrize("content,needle", [
    ("[model\nname=1", "is not valid TOML"),
    ("[model]\nname = 3\n", "model.name: Input should be a valid string"),
])
def test_malformed_config_is_one_line_error(tmp_path, content, needle):
    f = tmp_path / "c.toml"
    f.write_text(content)
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(f)
    assert "\n" not in str(e.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/deploy.toml")


def test_kog_config_validate_command(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[parallel]\nranks = 0\nfoo = 1\n")
    r = subprocess.run([sys.executable, "-m", "kog_core.cli", "config", "validate", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and any("parallel.ranks" in l for l in lines) and any("parallel.foo: unknown key" in l for l in lines)
    r = subprocess.run([sys.executable, "-m", "kog_core.cli", "config", "validate", str(EXAMPLE)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith(": ok")
