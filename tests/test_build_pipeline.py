"""The patch pipeline of scripts/build_llama.py: patches apply in order and only edit upstream files (one
patch per file), native/'s sources land in the tree unchanged, a broken patch is named, the cache key
follows patches/, native/ and flags, and the installed libllama carries the series hash."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pristine_tree(build_script, tmp_path_factory) -> Path:
    sdist = build_script.fetch_sdist(build_script.cache_dir() / "sdist")
    return build_script.extract_sdist(sdist, tmp_path_factory.mktemp("sdist"))


def _copy_series(src: Path, dst: Path) -> Path:
    for sub in ("patches", "native", "ggml_kernels"):
        if (src / sub).is_dir():
            shutil.copytree(src / sub, dst / sub)
    return dst


def _patched_files(patch: Path) -> list[tuple[str, str]]:
    """(old, new) path of each file section of a unified diff: a ``---`` line, ``+++``, then a hunk."""
    lines = patch.read_text().splitlines()
    return [(lines[i][4:].split("\t")[0], lines[i + 1][4:].split("\t")[0]) for i in range(len(lines) - 2)
            if lines[i].startswith("--- ") and lines[i + 1].startswith("+++ ") and lines[i + 2].startswith("@@ ")]


def test_series_applies_on_the_pinned_sdist(build_script, pristine_tree, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(pristine_tree, tree, symlinks=True)
    applied = build_script.apply_patches(tree, REPO / "patches")
    assert applied == sorted(p.name for p in (REPO / "patches").glob("*.patch"))
    assert applied[0] == "0001-pask-version.patch"
    build_script.copy_native(tree, REPO)
    header = (tree / "vendor" / "llama.cpp" / "include" / "pask.h").read_text()
    assert "pask_patch_version" in header


def test_patches_only_edit_upstream_files_one_patch_each(build_script):
    """New files live in native/, not in patches; each upstream file is edited by exactly one patch,
    so a patch never depends on the hunks of another and none edits a native source."""
    native = {f"vendor/llama.cpp/{rel.as_posix()}" for rel in build_script.native_sources(REPO)}
    owner: dict[str, str] = {}
    for patch in sorted((REPO / "patches").glob("*.patch")):
        files = _patched_files(patch)
        assert files, f"{patch.name} edits no file"
        assert "new file mode" not in patch.read_text(), patch.name
        for old, new in files:
            assert old != "/dev/null", f"{patch.name} creates {new}: put it in native/"
            assert new != "/dev/null", f"{patch.name} deletes {old}"
            path = new.removeprefix("b/")
            assert old.removeprefix("a/") == path, f"{patch.name} renames {old}"
            assert path not in native, f"{patch.name} edits native/'s {path}"
            assert path not in owner, f"{path} is edited by {owner.get(path)} and {patch.name}"
            owner[path] = patch.name


def test_native_sources_land_in_the_tree_unchanged(build_script, pristine_tree, tmp_path):
    """Every file of native/ but its README is a new file of the prepared tree, byte for byte."""
    sources = build_script.native_sources(REPO)
    assert Path("include/pask.h") in sources and Path("src/pask-kv-step.cpp") in sources
    assert Path("README.md") not in sources
    staged, _ = build_script.stage_tree(REPO, build_script.cache_dir(), tmp_path)
    for rel in sources:
        assert not (pristine_tree / "vendor" / "llama.cpp" / rel).exists(), f"native/{rel} is an upstream file"
        got = (staged / "vendor" / "llama.cpp" / rel).read_bytes()
        assert got == (REPO / "native" / rel).read_bytes(), f"native/{rel} changed on its way into the tree"


def test_native_source_may_not_replace_an_upstream_file(build_script, pristine_tree, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(pristine_tree, tree, symlinks=True)
    repo = tmp_path / "repo"
    (repo / "native" / "src").mkdir(parents=True)
    (repo / "native" / "src" / "pask-new.cpp").write_text("// ours\n")
    assert build_script.copy_native(tree, repo) == ["src/pask-new.cpp"]
    (repo / "native" / "src" / "llama-graph.cpp").write_text("// a whole upstream file\n")
    with pytest.raises(build_script.BuildError, match="native/src/llama-graph.cpp would replace"):
        build_script.copy_native(tree, repo)


def test_broken_patch_is_named(build_script, pristine_tree, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(pristine_tree, tree, symlinks=True)
    patches = tmp_path / "patches"
    patches.mkdir()
    good = (REPO / "patches" / "0001-pask-version.patch").read_text()
    (patches / "0001-pask-version.patch").write_text(good)
    # A patch whose context does not exist upstream.
    broken = good.replace("    unicode.cpp\n", "    unicode-that-does-not-exist.cpp\n")
    assert broken != good
    (patches / "0002-broken.patch").write_text(broken)
    with pytest.raises(build_script.PatchError, match="0002-broken.patch does not apply"):
        build_script.apply_patches(tree, patches)


def test_cache_key_follows_patches_and_flags(build_script, tmp_path):
    repo = _copy_series(REPO, tmp_path / "repo")
    base = build_script.make_plan(cuda=False, avx512=True, repo=repo)
    assert base.key == build_script.make_plan(cuda=False, avx512=True, repo=repo).key
    assert base.key != build_script.make_plan(cuda=False, avx512=False, repo=repo).key
    p = repo / "patches" / "0001-pask-version.patch"
    p.write_text(p.read_text() + "\n")
    changed = build_script.make_plan(cuda=False, avx512=True, repo=repo)
    assert changed.series_hash != base.series_hash
    assert changed.key != base.key
    (repo / "ggml_kernels").mkdir(exist_ok=True)
    (repo / "ggml_kernels" / "new-op.c").write_text("/* kernel */\n")
    kernel = build_script.make_plan(cuda=False, avx512=True, repo=repo)
    assert kernel.key != changed.key
    src = repo / "native" / "src" / "pask-version.cpp"
    src.write_text(src.read_text() + "// edited\n")
    edited = build_script.make_plan(cuda=False, avx512=True, repo=repo)
    assert edited.series_hash != kernel.series_hash and edited.key != kernel.key
    assert f"-DPASK_PATCH_SERIES={edited.series_hash}" in edited.flags


def test_portable_flags_never_enable_amx(build_script):
    for avx512 in (True, False):
        flags = build_script.make_plan(cuda=False, avx512=avx512).flags
        assert "-DGGML_NATIVE=OFF" in flags
        assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
        assert not any("AMX" in f and f.endswith("=ON") for f in flags)


def test_sync_tree_touches_only_changed_files(build_script, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.c").write_text("x")
    (src / "y.c").write_text("y")
    assert build_script.sync_tree(src, dst) == 2
    before = (dst / "a" / "x.c").stat().st_mtime_ns
    (src / "y.c").write_text("y2")
    (dst / "stale.c").write_text("old")
    assert build_script.sync_tree(src, dst) == 2  # y.c rewritten, stale.c removed
    assert (dst / "a" / "x.c").stat().st_mtime_ns == before
    assert (dst / "y.c").read_text() == "y2"
    assert not (dst / "stale.c").exists()


def test_cuda_without_cublas_fails_clearly(build_script, monkeypatch, tmp_path):
    fake = tmp_path / "cuda" / "bin"
    fake.mkdir(parents=True)
    nvcc = fake / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 0\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake))
    with pytest.raises(build_script.BuildError, match="cuBLAS"):
        build_script.cuda_flags(toolkit_roots=[], wheel_dirs=[])
    # the pinned nvidia-cublas wheel's layout: nvidia/cu13/{include,lib}, versioned sonames only
    wheel = tmp_path / "site" / "nvidia" / "cu13"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    (wheel / "include" / "cublas_v2.h").write_text("")
    for name in ("libcublas.so.13", "libcublasLt.so.13"):
        (wheel / "lib" / name).write_text("")
    flags = build_script.cuda_flags(toolkit_roots=[], wheel_dirs=[tmp_path / "site"])
    assert f"-DCMAKE_CUDA_ARCHITECTURES={build_script.CUDA_ARCHS}" in flags
    assert "86" in build_script.CUDA_ARCHS and "89" in build_script.CUDA_ARCHS and "90" in build_script.CUDA_ARCHS
    lib = next(f for f in flags if f.startswith("-DCUDA_cublas_LIBRARY=")).split("=", 1)[1]
    assert Path(lib).name == "libcublas.so" and Path(lib).resolve() == (wheel / "lib" / "libcublas.so.13").resolve()
    assert f"-DCMAKE_CUDA_FLAGS=-I{wheel / 'include'}" in flags
    (tmp_path / "cuda" / "include").mkdir()
    (tmp_path / "cuda" / "include" / "cublas_v2.h").write_text("")
    assert "-DGGML_CUDA=ON" in build_script.cuda_flags(toolkit_roots=[], wheel_dirs=[])
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(build_script.BuildError, match="nvcc"):
        build_script.cuda_flags(toolkit_roots=[], wheel_dirs=[])


def test_installed_libllama_reports_the_series_hash(build_script):
    from pask_local import native

    assert native.patch_version() == build_script.series_hash(REPO)
    info = native.build_info()
    assert info["series"] == build_script.series_hash(REPO)
    assert info["patches"] == sorted(p.name for p in (REPO / "patches").glob("*.patch"))


def test_bundle_is_the_patched_tree_without_what_no_build_compiles(build_script, tmp_path):
    """scripts/gpu_check's source: the series applied, small enough to travel to a GPU machine (64 MiB with
    the tree), nothing a library build compiles left out, and refused once the series changes."""
    import json
    import tarfile

    out = build_script.write_bundle(tmp_path / "src.tar.gz")
    assert out.stat().st_size < 16 * 2**20
    with tarfile.open(out) as tar:
        tar.extractall(tmp_path / "x", filter="tar")
    tree = tmp_path / "x" / "llama-cpp-python"
    info = json.loads((tree / build_script.BUNDLE_INFO_NAME).read_text())
    assert info["series"] == build_script.series_hash(REPO)
    assert info["patches"] == sorted(p.name for p in (REPO / "patches").glob("*.patch"))
    llama = tree / "vendor" / "llama.cpp"
    assert "pask_patch_version" in (llama / "include" / "pask.h").read_text()  # patched
    for kept in ("src", "ggml/src/ggml-cpu", "ggml/src/ggml-cuda", "ggml/src/ggml-rpc", "common", "vendor",
                 "CMakeLists.txt"):
        assert (llama / kept).exists(), kept
    for dropped in ("models", "docs", "tests", "tools", "ggml/src/ggml-vulkan", "ggml/src/ggml-metal"):
        assert not (llama / dropped).exists(), dropped
    assert not (tree / ".git").exists()
    assert build_script.check_bundle_tree(tree) == tree
    repo = _copy_series(REPO, tmp_path / "repo")
    p = repo / "patches" / "0001-pask-version.patch"
    p.write_text(p.read_text() + "\n")
    with pytest.raises(build_script.BuildError, match="bundle it again"):
        build_script.check_bundle_tree(tree, repo)
    with pytest.raises(build_script.BuildError, match="not a patched tree"):
        build_script.check_bundle_tree(tmp_path)


def test_build_options_are_checked(build_script, tmp_path, capsys):
    assert build_script.parse_archs("90") == "90"
    assert build_script.parse_archs("86, 89,90") == "86;89;90"
    assert build_script.parse_archs(None) == build_script.CUDA_ARCHS
    for bad in ("", "sm_90", "90;x", "12"):
        with pytest.raises(build_script.BuildError, match="--archs"):
            build_script.parse_archs(bad)
    assert build_script.main(["--tree", str(tmp_path)]) == 1
    assert "--tree builds a wheel only" in capsys.readouterr().err
    assert build_script.main(["--wheel-only", "--tree", str(tmp_path)]) == 1
    assert "not a patched tree" in capsys.readouterr().err
    assert build_script.main(["--bundle", str(tmp_path / "x.zip")]) == 1
    assert ".tar.gz" in capsys.readouterr().err
