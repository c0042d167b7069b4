"""scripts/build_llama.py --sanitize: its own cache key, source tree and build dir, -fsanitize in
the CMake flags, a separate venv only (the sanitizer build itself is run by scripts/sanitize_check,
outside the test suite: it takes long)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from conftest import REPO


def test_sanitize_plan_has_its_own_key_flavour_and_flags(build_script) -> None:
    default = build_script.make_plan(cuda=False, avx512=True)
    san = build_script.make_plan(cuda=False, avx512=True, sanitize=("address", "undefined"))
    asan = build_script.make_plan(cuda=False, avx512=True, sanitize=("address",))
    assert len({default.key, san.key, asan.key}) == 3
    assert default.flavour == "cpu" and default.build_type == "Release" and default.sanitize == ()
    assert san.flavour == "cpu-san-address-undefined" and san.build_type == "RelWithDebInfo"
    assert not any("SANITIZE" in f or "fsanitize" in f for f in default.flags)
    assert {"-DLLAMA_SANITIZE_ADDRESS=ON", "-DGGML_SANITIZE_ADDRESS=ON", "-DLLAMA_SANITIZE_UNDEFINED=ON",
            "-DGGML_SANITIZE_UNDEFINED=ON"} <= set(san.flags)
    assert not any("UNDEFINED" in f for f in asan.flags)
    args = shlex.split(san.cmake_args())  # how scikit-build-core reads CMAKE_ARGS
    assert "-DCMAKE_C_FLAGS=-fsanitize=address,undefined -fno-omit-frame-pointer" in args
    assert "-DCMAKE_CXX_FLAGS=-fsanitize=address,undefined -fno-omit-frame-pointer" in args
    assert "-DCMAKE_BUILD_TYPE=RelWithDebInfo" in args
    # the default build's CMAKE_ARGS are what they were before (no quoting needed, Release)
    assert default.cmake_args() == " ".join([*default.flags, "-DCMAKE_BUILD_TYPE=Release"])
    # portable CPU flags and the series are shared with the default build
    assert set(default.flags) < set(san.flags) and san.series_hash == default.series_hash


def test_sanitize_kinds_are_parsed_canonically(build_script) -> None:
    assert build_script.parse_sanitize("undefined, address") == ("address", "undefined")
    assert build_script.parse_sanitize("address,address") == ("address",)
    assert build_script.parse_sanitize(None) == ()
    for bad, msg in (("thread", "unsupported sanitizer thread"), (",", "needs a list"), ("memory,address", "memory")):
        with pytest.raises(build_script.BuildError, match=msg):
            build_script.parse_sanitize(bad)
    with pytest.raises(build_script.BuildError, match="CPU builds"):
        build_script.make_plan(cuda=True, sanitize=("address",))


def test_print_key_follows_sanitize(build_script, capsys) -> None:
    keys = []
    for argv in (["--print-key"], ["--print-key", "--sanitize", "address,undefined"],
                 ["--print-key", "--sanitize", "undefined,address"]):
        assert build_script.main(argv) == 0
        keys.append(capsys.readouterr().out.strip())
    assert keys[0] != keys[1] == keys[2]


def test_sanitize_refuses_the_default_environment(build_script, capsys) -> None:
    assert build_script.main(["--sanitize", "address,undefined"]) == 1
    assert "--venv" in capsys.readouterr().err
    assert build_script.main(["--sanitize", "address", "--venv", sys.prefix]) == 1
    assert "is the running environment" in capsys.readouterr().err


def test_sanitize_check_script_runs_the_native_tests_under_asan() -> None:
    text = (REPO / "scripts" / "sanitize_check").read_text()
    assert "--sanitize address,undefined --venv" in text and "libasan.so" in text
    assert "detect_leaks=0" in text
    for t in ("tests/test_kv_layered_*.py", "tests/test_grammar_state.py", "tests/test_attention_probe.py"):
        assert t in text
        assert list(REPO.glob(t)), t
    assert Path(REPO / "scripts" / "sanitize_check").stat().st_mode & 0o111
