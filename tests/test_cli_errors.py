"""Bad input to the CLI gives one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

SCHEMA = str(REPO / "examples" / "get_weather.json")


def assert_one_line_error(proc, needle: str) -> None:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "text.gguf").write_text("this is not a model\n")
    (d / "corrupt.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 200)
    (d / "trunc.gguf").write_bytes(b"GGUF")
    (d / "bad.json").write_text("{not json")
    (d / "empty.json").write_text("[]")
    (d / "policy26.json").write_text(json.dumps({
        "format": "pask-policy", "version": 1, "kind": "hand-written", "n_layer": 26,
        "groups": [list(range(26))], "floors": [{}], "weights": [{}]}))
    return d


@pytest.mark.parametrize("gguf,needle", [
    ("/nonexistent/model.gguf", "model file not found"),
    ("text.gguf", "not a GGUF file"),
    ("trunc.gguf", "truncated"),
    ("corrupt.gguf", "metadata entries"),  # gguf_check, before llama.cpp reads it
    ("hf://nobody/nothing/model.gguf", "unreachable"),
])
def test_bad_model_paths(cli, bad_files, gguf, needle):
    path = gguf if gguf.startswith(("/", "hf://")) else str(bad_files / gguf)
    proc = cli("info", "--gguf", path, env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(proc, needle)
    proc = cli("run", "--gguf", path, "--schema", SCHEMA, "hello", env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(proc, needle)


@pytest.mark.parametrize("args,needle", [
    (["--budget", "0"], "--budget must be in (0, 1]"),
    (["--budget", "1.5"], "--budget must be in (0, 1]"),
    (["--method", "magic"], "unknown method 'magic'"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--ngl", "-3"], "--ngl must be -1 (all layers) or >= 0"),
    (["--hysteresis", "-1"], "--hysteresis must be in [0, 0.5]"),
    (["--kv-type", "q9"], "unknown --kv-type 'q9'"),
    (["--temperature", "2.5"], "temperature must be in [0, 2]"),
    (["--top-p", "-0.1"], "top_p must be in [0, 1]"),
])
def test_bad_run_options(cli, args, needle):
    assert_one_line_error(cli("run", "--schema", SCHEMA, *args, "hello"), needle)


def test_bad_schemas(cli, bad_files):
    assert_one_line_error(cli("run", "--schema", str(bad_files / "bad.json"), "hi"), "not valid JSON")
    assert_one_line_error(cli("run", "--schema", str(bad_files / "empty.json"), "hi"), "empty")
    assert_one_line_error(cli("run", "--schema", str(bad_files / "missing.json"), "hi"), "not found")
    assert_one_line_error(cli("run", "hi"), "--schema FILE is required")


def test_policy_for_another_model(cli, bad_files):
    proc = cli("run", "--schema", SCHEMA, "--policy", str(bad_files / "policy26.json"), "hi")
    assert_one_line_error(proc, "26 layers but the model has 18")
    proc = cli("run", "--schema", SCHEMA, "--method", "snapkv", "--policy", str(bad_files / "policy26.json"), "hi")
    assert_one_line_error(proc, "applies to pask, pask-attn, pask-hybrid and pask-tools only")
    proc = cli("run", "--schema", SCHEMA, "--method", "pask-prior", "--policy", str(bad_files / "policy26.json"), "hi")
    assert_one_line_error(proc, "hand-written prior")


def test_prompt_longer_than_context(cli):
    proc = cli("run", "--schema", SCHEMA, "--max-tokens", "40000", "weather in Rome")
    assert_one_line_error(proc, "exceed")


def test_usage_errors_exit_2(cli):
    proc = cli("run", "--no-such-flag")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "No such option" in proc.stderr
