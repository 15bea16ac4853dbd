"""The CLI's bad-input paths: one line on stderr, exit status 2, never a traceback."""
import json
import os
import subprocess
import sys

import pytest


def kog(*args, stdin=None, env=None):
    return subprocess.run([sys.executable, "-m", "kog_core.cli", *args], capture_output=True, text=True,
                          input=stdin, env={**os.environ, **(env or {})}, timeout=300)


def assert_one_line_error(r, needle):
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize("args,needle", [
    (["run", "--model", "/no/such/model.gguf", "hi"], "does not exist"),
    (["run", "--model", "no-such-preset", "hi"], "unknown model 'no-such-preset'"),
    (["run", "--model", "smollm2-135m", "--backend", "cuda_magic", "--random-weights", "hi"], "unknown backend 'cuda_magic'; available:"),
    (["run", "--config", "/no/such.toml", "hi"], "config file /no/such.toml does not exist"),
    (["run", "--model", "smollm2-135m", "--random-weights", "--prompt-ids", "1,x"], "--prompt-ids takes integers"),
    (["run", "--model", "smollm2-135m", "--random-weights", "--prompt-ids", "99999999"], "outside the vocabulary"),
    (["run", "--model", "smollm2-135m", "--random-weights", "--context-length", "99999", "--prompt-ids", "1"], "exceeds the model's maximum"),
    (["run", "--model", "smollm2-135m", "--random-weights", "--temperature", "-2", "--prompt-ids", "1"], "sampling.temperature"),
    (["run", "--model", "bench-2b", "--random-weights", "--backend", "nvidia_hopper", "--prompt-ids", "1"], "nvidia_hopper"),
    (["inspect", "no-such-model"], "unknown model"),
    (["pull", "no-such-model"], "unknown model"),
])
def test_bad_input_gives_one_line_error(args, needle):
    assert_one_line_error(kog(*args), needle)


def test_malformed_config_file(tmp_path):
    f = tmp_path / "deploy.toml"
    f.write_text("[model]\nname = 'smollm2-135m'\nbogus = 1\n")
    assert_one_line_error(kog("run", "--config", str(f), "hi"), "model.bogus: unknown key")


def test_checkpoint_that_does_not_match_its_config(tmp_path):
    """A HF directory whose config.json claims other shapes than its tensors."""
    import numpy as np
    from safetensors.numpy import save_file
    cfg = dict(model_type="llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
               intermediate_size=48, vocab_size=50, max_position_embeddings=64, tie_word_embeddings=True)
    from kog_moe_standard_tp.llama import Llama
    weights = Llama(cfg).random_weights(0)
    weights["model.layers.0.mlp.up_proj.weight"] = np.zeros((40, 32), np.float32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = kog("run", "--model", str(tmp_path), "--prompt-ids", "1,2")
    assert_one_line_error(r, "model.layers.0.mlp.up_proj.weight has shape [40, 32], expected [48, 32]")


def test_inspect_prints_program_and_bytes():
    r = kog("inspect", "bench-2b")
    assert r.returncode == 0
    assert "bytes per token (bf16 weights, bf16 KV): weights 3.797 GB" in r.stdout


def test_bench_on_the_cpu_ends_with_json():
    r = kog("bench", "--model", "smollm2-135m", "--random-weights", "--tokens", "8", "--prompt-tokens", "4",
            "--backend", "reference")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["generated_tokens"] == 8 and out["decode_tok_s"] > 0 and 0 < out["mbu"] < 2


def test_bench_sampled_decoding_says_so():
    r = kog("bench", "--model", "smollm2-135m", "--random-weights", "--tokens", "8", "--prompt-tokens", "4",
            "--backend", "reference", "--temperature", "0.8", "--top-k", "40", "--top-p", "0.9")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["generated_tokens"] == 8 and out["sampling"] == "temperature 0.8, top-k 40, top-p 0.9"
    assert "(temperature 0.8, top-k 40, top-p 0.9)" in r.stdout


def test_bench_rejects_a_bad_top_p_in_one_line():
    r = kog("bench", "--model", "smollm2-135m", "--random-weights", "--backend", "reference", "--temperature", "1",
            "--top-p", "1.5")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "top_p" in r.stderr


def test_run_json_and_stdin(demo_gguf):
    r = kog("run", "--model", str(demo_gguf), "--json", "-n", "12", stdin="What is the capital of France?")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"] and out["finish_reason"] in ("stop", "length") and out["token_ids"]
