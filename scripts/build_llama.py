#!/usr/bin/env python3
"""Build and install pask-local's patched llama-cpp-python wheel, reproducibly and cached.

Steps (each fails loudly with a one-line reason):
1. fetch the sdist of llama-cpp-python at the pinned version with pip and check its sha256;
2. extract it and apply every ``patches/*.patch`` in name order (``patch -p1``; they only edit upstream
   files), copy our own new sources ``native/`` into ``vendor/llama.cpp/`` (new files only, same relative
   paths) and ``ggml_kernels/`` into the tree as ``vendor/llama.cpp/pask_kernels``;
3. sync the result into a persistent source tree (only changed files are touched, so the
   persistent CMake build dir rebuilds incrementally) and build a wheel with portable CPU flags
   (GGML_NATIVE=OFF, explicit AVX2/FMA/F16C[/AVX512], never AMX; the RPC backend, without RDMA) or ``--cuda``;
4. cache the wheel under a key (sdist sha256, hash of patches/ + native/ + ggml_kernels/, flags) and
   install it into the running interpreter's environment. An unchanged tree never rebuilds.

``--bundle OUT.tar.gz`` writes step 2's patched tree, without what no library build compiles (models,
docs, tests, tools, other backends' sources), as a small tarball for a machine that cannot fetch the
sdist (a lent GPU machine: ``scripts/gpu_check``); ``--tree DIR`` builds from such a tree instead of
the sdist (it must carry this repo's series hash). ``--archs`` overrides the CUDA architectures.

``--sanitize address,undefined`` builds the same series with ASan/UBSan (RelWithDebInfo, frame
pointers) into its own source tree, build dir and cache key, and installs it only into a separate
virtual environment (``--venv .venv-asan``), never the default one; ``scripts/sanitize_check``
runs the native tests under it.

Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

PINNED_VERSION = "0.3.36"
PINNED_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_INFO_NAME = "pask_build.json"
# The folders whose bytes make up the series (series_hash, the cache key, PASK_PATCH_SERIES).
SERIES_DIRS = ("patches", "native", "ggml_kernels")
# native/'s description of itself: the one file of native/ that is not a source of the tree.
NATIVE_README = "README.md"

# Targets Python never loads: skipping them cuts the build roughly in half.
SKIP_FLAGS = [
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_CURL=OFF",
]
# AMX kernels segfault on quantized models on the AMX Xeons we run on: always off.
NO_AMX = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
# --sanitize kinds -> the llama.cpp/ggml CMake options that compile and link with -fsanitize
SANITIZERS = {
    "address": ["-DLLAMA_SANITIZE_ADDRESS=ON", "-DGGML_SANITIZE_ADDRESS=ON"],
    "undefined": ["-DLLAMA_SANITIZE_UNDEFINED=ON", "-DGGML_SANITIZE_UNDEFINED=ON"],
}


class BuildError(RuntimeError):
    """A build step failed; the message is one line meant for the user."""


class PatchError(BuildError):
    """A patch of the series does not apply."""


@dataclass(frozen=True)
class BuildPlan:
    sdist_sha256: str
    series_hash: str
    flags: tuple[str, ...]
    sanitize: tuple[str, ...] = ()

    @property
    def flavour(self) -> str:
        """cpu | cuda, plus -san-<kinds> for a sanitizer build (its own source tree and build dir)."""
        base = "cuda" if "-DGGML_CUDA=ON" in self.flags else "cpu"
        return base + ("-san-" + "-".join(self.sanitize) if self.sanitize else "")

    @property
    def build_type(self) -> str:
        return "RelWithDebInfo" if self.sanitize else "Release"

    def cmake_args(self) -> str:
        """The CMAKE_ARGS environment value (shell-quoted: sanitizer C flags contain spaces)."""
        return shlex.join([*self.flags, f"-DCMAKE_BUILD_TYPE={self.build_type}"])

    @property
    def key(self) -> str:
        h = hashlib.sha256()
        h.update(self.sdist_sha256.encode())
        h.update(self.series_hash.encode())
        h.update("\0".join(self.flags).encode())
        return h.hexdigest()[:24]


def cache_dir() -> Path:
    root = os.environ.get("PASK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pask-local"
    )
    return Path(root)


def _series_files(repo: Path) -> list[Path]:
    files: list[Path] = []
    for sub in SERIES_DIRS:
        d = repo / sub
        if d.is_dir():
            files += [p for p in sorted(d.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    return files


def series_hash(repo: Path = REPO_ROOT) -> str:
    """sha256 (first 16 hex digits) over the relative paths and bytes of patches/, native/ and ggml_kernels/."""
    h = hashlib.sha256()
    for p in _series_files(repo):
        h.update(p.relative_to(repo).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def host_has_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f" in flags


def cpu_flags(avx512: bool) -> list[str]:
    flags = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
    flags.append("-DGGML_AVX512=ON" if avx512 else "-DGGML_AVX512=OFF")
    return flags + NO_AMX + RPC


# ggml's RPC backend (docs/rpc.md): `pask-local rpc-server` and --rpc. RDMA off: it would link libibverbs
# whenever the build host has it, and a wheel must load on hosts without it.
RPC = ["-DGGML_RPC=ON", "-DGGML_RPC_RDMA=OFF"]


CUBLAS_WHEEL = "nvidia-cublas==13.10.0.20"   # cuBLAS 13 headers + libraries (nvidia/cu13/{include,lib})
CUDA_ARCHS = "86;89;90"                       # RTX 30 / RTX 40 laptops, H100/H200: no JIT at load
BUNDLE_INFO_NAME = "pask_bundle.json"
# What a bundle leaves out of the patched tree: nothing the library build (SKIP_FLAGS, LLAVA off) compiles.
BUNDLE_DROP = (".git", "docker", "docs", "examples", "tests", "vendor/llama.cpp/models", "vendor/llama.cpp/docs",
               "vendor/llama.cpp/media", "vendor/llama.cpp/benches", "vendor/llama.cpp/examples",
               "vendor/llama.cpp/pocs", "vendor/llama.cpp/tests", "vendor/llama.cpp/gguf-py",
               "vendor/llama.cpp/conversion", "vendor/llama.cpp/tools",
               "vendor/llama.cpp/ci", "vendor/llama.cpp/skills", "vendor/llama.cpp/requirements",
               "vendor/llama.cpp/grammars", "vendor/llama.cpp/scripts",
               "vendor/llama.cpp/.github", "vendor/llama.cpp/.devops")
BUNDLE_BACKENDS = ("ggml-cpu", "ggml-cuda", "ggml-rpc")   # ggml/src backend directories a bundle keeps


def wheel_cublas(dirs: list[Path]) -> Path | None:
    """The nvidia/cu13 directory of an installed nvidia-cublas wheel under one of ``dirs``, if any."""
    for d in dirs:
        root = d / "nvidia" / "cu13"
        if (root / "include" / "cublas_v2.h").is_file() and any((root / "lib").glob("libcublas.so*")):
            return root
    return None


def fetch_cublas_wheel(target: Path) -> Path:
    """pip-install the pinned nvidia-cublas wheel into ``target`` (no deps); its nvidia/cu13 dir."""
    log(f"fetching {CUBLAS_WHEEL} (cuBLAS headers and libraries) into {target}")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                           CUBLAS_WHEEL], capture_output=True, text=True)
    root = wheel_cublas([target])
    if proc.returncode != 0 or root is None:
        raise BuildError(f"could not install {CUBLAS_WHEEL}: {_last_line(proc.stderr)}")
    return root


def cublas_link_dir(root: Path) -> Path:
    """A lib dir with the unversioned libcublas.so / libcublasLt.so names CMake's FindCUDAToolkit links."""
    link = root / "link"
    link.mkdir(exist_ok=True)
    for name in ("libcublas", "libcublasLt"):
        real = sorted((root / "lib").glob(f"{name}.so.*"))
        if not real:
            raise BuildError(f"{root / 'lib'} has no {name}.so.*")
        dst = link / f"{name}.so"
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        dst.symlink_to(real[0])
    return link


def _has_libcuda(roots: list[Path]) -> bool:
    import ctypes.util

    stubs = [p for r in roots for p in (*r.glob("lib64/stubs/libcuda.so"), *r.glob("targets/*/lib/stubs/libcuda.so"))]
    return bool(stubs) or ctypes.util.find_library("cuda") is not None


def cuda_flags(toolkit_roots: list[Path] | None = None, wheel_dirs: list[Path] | None = None,
               fetch: bool = False, archs: str = CUDA_ARCHS) -> list[str]:
    """CMake flags for a CUDA build; BuildError when nvcc or the cuBLAS headers are missing.

    ``toolkit_roots``: where to look for include/cublas_v2.h besides nvcc's own toolkit
    (default: $CUDA_HOME and /usr/local/cuda*). Without them, cuBLAS comes from the pinned
    ``nvidia-cublas`` wheel installed under one of ``wheel_dirs`` (default: the build cache's
    cuda-deps and this interpreter's site-packages), which ``fetch`` installs when missing.
    Architectures: ``archs`` (default ``CUDA_ARCHS``).
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise BuildError("--cuda needs nvcc on PATH (install the CUDA toolkit)")
    if toolkit_roots is None:
        toolkit_roots = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")), *Path("/usr/local").glob("cuda*")]
    roots = [Path(nvcc).resolve().parent.parent, *toolkit_roots]
    headers = [r / "include" / "cublas_v2.h" for r in roots]
    headers += [h for r in roots for h in r.glob("targets/*/include/cublas_v2.h")]
    base = ["-DGGML_CUDA=ON", "-DGGML_NATIVE=OFF", f"-DCMAKE_CUDA_ARCHITECTURES={archs}", *NO_AMX]
    if not _has_libcuda(roots):
        # no driver library (nor the toolkit's stub) to link: ggml-cuda then skips its VMM pool,
        # the one feature that links libcuda directly (the legacy pool allocates instead)
        base.append("-DGGML_CUDA_NO_VMM=ON")
    if any(h.is_file() for h in headers):
        return base
    if wheel_dirs is None:
        import site

        wheel_dirs = [cache_dir() / "cuda-deps", *(Path(p) for p in site.getsitepackages())]
    root = wheel_cublas(wheel_dirs)
    if root is None and fetch:
        root = fetch_cublas_wheel(cache_dir() / "cuda-deps")
    if root is None:
        raise BuildError(
            "--cuda needs the cuBLAS headers (cublas_v2.h not found next to "
            f"{nvcc}, nor an installed {CUBLAS_WHEEL} wheel); install libcublas-dev / the CUDA toolkit's "
            "cuBLAS component, or that wheel"
        )
    link = cublas_link_dir(root)
    inc = root / "include"
    return [*base, f"-DCUDA_cublas_LIBRARY={link / 'libcublas.so'}",
            f"-DCUDA_cublasLt_LIBRARY={link / 'libcublasLt.so'}",
            f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}"]


def parse_sanitize(text: str | None) -> tuple[str, ...]:
    """``"address,undefined"`` -> ("address", "undefined") (sorted, unique); BuildError on other kinds."""
    if text is None:
        return ()
    kinds = sorted({k.strip() for k in text.split(",") if k.strip()})
    if not kinds:
        raise BuildError("--sanitize needs a list of sanitizers: address, undefined")
    bad = [k for k in kinds if k not in SANITIZERS]
    if bad:
        raise BuildError(f"unsupported sanitizer {', '.join(bad)} (supported: {', '.join(SANITIZERS)})")
    return tuple(kinds)


def sanitize_flags(kinds: tuple[str, ...]) -> list[str]:
    """CMake flags for a sanitizer build: the llama/ggml options plus -fsanitize for every C/C++ file."""
    if not kinds:
        return []
    fs = f"-fsanitize={','.join(kinds)} -fno-omit-frame-pointer"
    out = [f for k in kinds for f in SANITIZERS[k]]
    return [*out, f"-DCMAKE_C_FLAGS={fs}", f"-DCMAKE_CXX_FLAGS={fs}",
            f"-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize={','.join(kinds)}"]


def parse_archs(text: str | None) -> str:
    """``"90"`` or ``"86;89;90"`` (commas allowed) -> CMake's list; BuildError on anything else."""
    if text is None:
        return CUDA_ARCHS
    archs = [a.strip() for a in text.replace(",", ";").split(";") if a.strip()]
    if not archs or not all(a.isdigit() and 50 <= int(a) <= 200 for a in archs):
        raise BuildError(f"--archs takes CUDA architectures such as 86;89;90, got {text!r}")
    return ";".join(archs)


def make_plan(cuda: bool, avx512: bool | None = None, repo: Path = REPO_ROOT,
              sanitize: tuple[str, ...] = (), archs: str = CUDA_ARCHS) -> BuildPlan:
    series = series_hash(repo)
    if avx512 is None:
        avx512 = host_has_avx512()
    if sanitize and cuda:
        raise BuildError("--sanitize builds are CPU builds (drop --cuda)")
    flags = cuda_flags(fetch=True, archs=archs) if cuda else cpu_flags(avx512)
    flags = [*flags, *SKIP_FLAGS, *sanitize_flags(tuple(sanitize)), f"-DPASK_PATCH_SERIES={series}"]
    return BuildPlan(PINNED_SHA256, series, tuple(flags), tuple(sanitize))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_sdist(dest: Path) -> Path:
    """The pinned sdist, downloaded once with pip and verified against PINNED_SHA256."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / f"llama_cpp_python-{PINNED_VERSION}.tar.gz"
    if not target.is_file():
        log(f"downloading llama-cpp-python=={PINNED_VERSION} sdist")
        tmp = Path(tempfile.mkdtemp(dir=dest))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--no-build-isolation", "-q", f"llama-cpp-python=={PINNED_VERSION}", "-d", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = list(tmp.glob("*.tar.gz"))
        if proc.returncode != 0 or not got:
            raise BuildError(f"could not download the llama-cpp-python sdist: {_last_line(proc.stderr)}")
        got[0].replace(target)
        shutil.rmtree(tmp, ignore_errors=True)
    digest = sha256_file(target)
    if digest != PINNED_SHA256:
        target.unlink()
        raise BuildError(f"sdist sha256 mismatch: got {digest}, pinned {PINNED_SHA256}")
    return target


def extract_sdist(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="tar")
    roots = [p for p in into.iterdir() if p.is_dir()]
    if len(roots) != 1:
        raise BuildError(f"unexpected sdist layout in {sdist.name}")
    return roots[0]


def apply_patches(tree: Path, patches_dir: Path) -> list[str]:
    """Apply patches_dir/*.patch in name order; PatchError names the first that fails."""
    applied = []
    for patch in sorted(patches_dir.glob("*.patch")):
        proc = subprocess.run(
            ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-i", str(patch)],
            cwd=tree, capture_output=True, text=True,
        )
        if proc.returncode != 0:
            detail = _last_line(proc.stdout + proc.stderr)
            raise PatchError(f"patch {patch.name} does not apply: {detail}")
        applied.append(patch.name)
    return applied


def native_sources(repo: Path) -> list[Path]:
    """The files of ``repo/native`` that go into the tree, relative to it (its README stays behind)."""
    root = repo / "native"
    if not root.is_dir():
        return []
    files = [p.relative_to(root) for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    return [rel for rel in files if rel != Path(NATIVE_README)]


def copy_native(tree: Path, repo: Path) -> list[str]:
    """Copy native/'s sources to the same paths under the tree's vendor/llama.cpp/; their paths.

    They must be new files: an upstream file is changed by a patch, never replaced wholesale, so a
    source that would overwrite one (or a file a patch created) is a BuildError.
    """
    llama = tree / "vendor" / "llama.cpp"
    copied = []
    for rel in native_sources(repo):
        dst = llama / rel
        if dst.exists() or dst.is_symlink():
            raise BuildError(f"native/{rel.as_posix()} would replace {dst.relative_to(tree)}: "
                             "edit upstream files with a patch")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / "native" / rel, dst)
        copied.append(rel.as_posix())
    return copied


def sync_tree(src: Path, dst: Path) -> int:
    """Make dst a copy of src touching only files whose bytes differ; return how many changed."""
    changed = 0
    dst.mkdir(parents=True, exist_ok=True)
    wanted: set[Path] = set()
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        wanted.add(rel)
        out = dst / rel
        if path.is_dir() and not path.is_symlink():
            out.mkdir(exist_ok=True)
            continue
        if out.is_file() and not out.is_symlink() and path.stat().st_size == out.stat().st_size:
            if path.read_bytes() == out.read_bytes():
                continue
        if out.is_dir() and not out.is_symlink():
            shutil.rmtree(out)
        elif out.exists() or out.is_symlink():
            out.unlink()
        shutil.copy2(path, out, follow_symlinks=False)
        changed += 1
    for path in sorted(dst.rglob("*"), reverse=True):
        if path.relative_to(dst) not in wanted:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            changed += 1
    return changed


def installed_build_info(python: str | None = None) -> dict | None:
    """The pask_build.json of the llama_cpp importable by ``python`` (default: this interpreter), if any."""
    code = (
        "import importlib.util,pathlib,sys;s=importlib.util.find_spec('llama_cpp');"
        f"p=pathlib.Path(s.origin).parent/'{BUILD_INFO_NAME}' if s else None;"
        "sys.stdout.write(p.read_text() if p and p.is_file() else '')"
    )
    proc = subprocess.run([python or sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        return None


def stage_tree(repo: Path, cache: Path, into: Path) -> tuple[Path, list[str]]:
    """The pinned sdist extracted under ``into``, the series applied, native/ and ggml_kernels/ copied in."""
    sdist = fetch_sdist(cache / "sdist")
    staged = extract_sdist(sdist, into)
    names = apply_patches(staged, repo / "patches")
    log(f"applied {len(names)} patch(es): {', '.join(names) or '-'}")
    # after the patches: a patch cannot edit a native file (it is not there yet), and copy_native
    # refuses to overwrite a file a patch created
    log(f"copied {len(copy_native(staged, repo))} native source(s)")
    kernels = repo / "ggml_kernels"
    if kernels.is_dir():
        shutil.copytree(kernels, staged / "vendor" / "llama.cpp" / "pask_kernels",
                        ignore=shutil.ignore_patterns("__pycache__"))
    return staged, names


def prune_for_bundle(tree: Path) -> None:
    """Remove from a patched tree what no library build compiles (``BUNDLE_DROP``, other backends)."""
    for rel in BUNDLE_DROP:
        p = tree / rel
        if p.is_dir():
            shutil.rmtree(p)
    backends = tree / "vendor" / "llama.cpp" / "ggml" / "src"
    for d in backends.iterdir():
        if d.is_dir() and d.name.startswith("ggml-") and d.name not in BUNDLE_BACKENDS:
            shutil.rmtree(d)


def write_bundle(out: Path, repo: Path = REPO_ROOT) -> Path:
    """The patched, pruned tree as ``out`` (.tar.gz) with ``pask_bundle.json`` (series hash, patches)."""
    if not out.name.endswith(".tar.gz"):
        raise BuildError(f"--bundle writes a .tar.gz file, got {out}")
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        staged, names = stage_tree(repo, cache, Path(tmp))
        prune_for_bundle(staged)
        info = {"series": series_hash(repo), "patches": names, "sdist_sha256": PINNED_SHA256,
                "version": PINNED_VERSION}
        (staged / BUNDLE_INFO_NAME).write_text(json.dumps(info, indent=1) + "\n")
        part = out.with_name(out.name + ".part")
        with tarfile.open(part, "w:gz") as tar:
            tar.add(staged, arcname="llama-cpp-python")
        part.replace(out)
    log(f"bundle {out} ({out.stat().st_size / 2**20:.1f} MiB, series {info['series']})")
    return out


def check_bundle_tree(tree: Path, repo: Path = REPO_ROOT) -> Path:
    """A tree made by ``--bundle`` for this repo's series (BuildError otherwise); the tree."""
    info_path = tree / BUNDLE_INFO_NAME
    if not info_path.is_file():
        raise BuildError(f"{tree} is not a patched tree made by --bundle (no {BUNDLE_INFO_NAME})")
    try:
        info = json.loads(info_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BuildError(f"{info_path} is not JSON") from None
    want = series_hash(repo)
    if not isinstance(info, dict) or info.get("series") != want:
        got = info.get("series") if isinstance(info, dict) else None
        raise BuildError(f"{tree} was bundled from patch series {got}, this repo's is {want}: bundle it again")
    return tree


def build_wheel(plan: BuildPlan, repo: Path, cache: Path, verbose: bool, tree_src: Path | None = None) -> Path:
    wheel_dir = cache / "wheels" / plan.key
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if wheels:
        log(f"cached wheel {plan.key}")
        return wheels[0]
    flavour = plan.flavour
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        if tree_src is None:
            staged, names = stage_tree(repo, cache, Path(tmp))
        else:  # a bundle's tree (check_bundle_tree): already patched
            staged = Path(tmp) / "tree"
            shutil.copytree(tree_src, staged, symlinks=True)
            names = json.loads((staged / BUNDLE_INFO_NAME).read_text())["patches"]
        info = {"key": plan.key, "series": plan.series_hash, "sdist_sha256": plan.sdist_sha256,
                "flags": list(plan.flags), "patches": names, "version": PINNED_VERSION,
                "sanitize": list(plan.sanitize)}
        (staged / "llama_cpp" / BUILD_INFO_NAME).write_text(json.dumps(info, indent=1) + "\n")
        tree = cache / "src" / f"{plan.sdist_sha256[:12]}-{flavour}"
        changed = sync_tree(staged, tree)
        log(f"source tree {tree} ({changed} file(s) changed)")
    build_dir = cache / "build" / f"{plan.sdist_sha256[:12]}-{flavour}"
    out = Path(tempfile.mkdtemp(dir=cache))
    env = dict(os.environ)
    env["CMAKE_ARGS"] = plan.cmake_args()
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out),
           "-C", f"build-dir={build_dir}", "-C", f"cmake.build-type={plan.build_type}", str(tree)]
    if flavour.startswith("cuda"):  # docs/native-step.md: 144 CUDA objects, each compiled per architecture
        log(f"building wheel ({flavour}; a full CUDA build for 3 architectures is ~1.7 core-hours, ~50 min on "
            "2 idle cores; its build dir persists, so a stopped build resumes where it was)")
    else:
        log(f"building wheel ({flavour}; a full build takes 6-15 min on 2 cores, incremental ~2 min)")
    logfile = cache / f"build-{flavour}.log"
    with open(logfile, "w") as lf:
        proc = subprocess.run(cmd, env=env, stdout=None if verbose else lf, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "" if verbose else _last_error(logfile)
        raise BuildError(f"wheel build failed (log: {logfile}){': ' + tail if tail else ''}")
    built = sorted(out.glob("*.whl"))
    if not built:
        raise BuildError(f"pip wheel produced no wheel (log: {logfile})")
    wheel_dir.mkdir(parents=True, exist_ok=True)
    final = wheel_dir / built[0].name
    built[0].replace(final)
    shutil.rmtree(out, ignore_errors=True)
    return final


def ensure_build_backend() -> None:
    probe = subprocess.run([sys.executable, "-c", "import scikit_build_core"], capture_output=True)
    if probe.returncode != 0:
        log("installing scikit-build-core (build backend)")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "scikit-build-core>=0.9.2"])
        if proc.returncode != 0:
            raise BuildError("could not install scikit-build-core")


def venv_python(venv: Path) -> str:
    """The interpreter of a separate virtual environment for a sanitizer wheel, created if missing;
    BuildError when it is the environment this script runs in (the default wheel lives there)."""
    venv = venv.resolve()
    if venv == Path(sys.prefix).resolve():
        raise BuildError(f"--venv {venv} is the running environment; a sanitizer wheel needs its own venv")
    python = venv / "bin" / "python"
    if not python.is_file():
        log(f"creating {venv}")
        proc = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"could not create the venv {venv}: {_last_line(proc.stderr)}")
    return str(python)


def install(cuda: bool = False, force: bool = False, verbose: bool = False,
            repo: Path = REPO_ROOT, sanitize: tuple[str, ...] = (), venv: Path | None = None) -> Path | None:
    """Ensure the patched wheel for the current tree is built, cached and installed (a sanitizer
    build: into ``venv`` only, with the project and its test dependencies)."""
    plan = make_plan(cuda, repo=repo, sanitize=sanitize)
    if sanitize and venv is None:
        raise BuildError("--sanitize installs only into a separate venv: add --venv PATH (e.g. .venv-asan)")
    python = venv_python(venv) if venv is not None else sys.executable
    current = installed_build_info(python)
    if not force and current and current.get("key") == plan.key:
        log(f"patched llama-cpp-python up to date (series {plan.series_hash}, key {plan.key})")
        return None
    with _flavour_lock(plan) as cache:
        wheel = build_wheel(plan, repo, cache, verbose)
        log(f"installing {wheel.name}" + (f" into {venv}" if venv is not None else ""))
        proc = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps",
                               "--force-reinstall", str(wheel)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"pip could not install {wheel}: {_last_line(proc.stderr)}")
        if venv is not None:  # the project itself (its other dependencies from the index), editable
            proc = subprocess.run([python, "-m", "pip", "install", "-q", "-e", f"{repo}[dev]"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise BuildError(f"pip could not install pask-local into {venv}: {_last_line(proc.stderr)}")
    log(f"installed patched llama-cpp-python (series {plan.series_hash}, key {plan.key})")
    return wheel


def build_only(cuda: bool, verbose: bool = False, repo: Path = REPO_ROOT, archs: str = CUDA_ARCHS,
               tree: Path | None = None) -> Path:
    """Build (or find cached) the wheel for the current tree without installing it; its path.
    ``tree``: build from a bundle's patched tree instead of the sdist."""
    if tree is not None:
        check_bundle_tree(tree, repo)
    plan = make_plan(cuda, repo=repo, archs=archs)
    with _flavour_lock(plan) as cache:
        return build_wheel(plan, repo, cache, verbose, tree)


@contextlib.contextmanager
def _flavour_lock(plan: BuildPlan):
    """The build cache, held under this flavour's lock, with the build backend installed.

    One lock per flavour (its source tree and build dir): a long sanitizer or CUDA build does not
    hold up the CPU build of scripts/setup; the shared sdist is fetched atomically.
    """
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"build-{plan.flavour}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ensure_build_backend()
        yield cache


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def _last_error(logfile: Path) -> str:
    lines = logfile.read_text(errors="replace").splitlines()
    errs = [ln.strip() for ln in lines if ": error:" in ln or ": fatal error:" in ln]
    errs = errs or [ln.strip() for ln in lines if "error" in ln.lower()]
    return (errs[0] if errs else _last_line("\n".join(lines)))[:300]


def log(msg: str) -> None:
    print(f"[build_llama] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", help="build with GGML_CUDA=ON (needs nvcc + cuBLAS)")
    ap.add_argument("--force", action="store_true", help="reinstall even when the installed build matches")
    ap.add_argument("--verbose", action="store_true", help="stream the compiler output")
    ap.add_argument("--print-key", action="store_true", help="print the cache key and exit")
    ap.add_argument("--sanitize", metavar="KINDS", help="build with sanitizers: address,undefined (needs --venv)")
    ap.add_argument("--venv", type=Path, help="install into this separate virtual environment (created if missing)")
    ap.add_argument("--wheel-only", action="store_true",
                    help="build and cache the wheel, print its path, install nothing (e.g. a CUDA wheel here)")
    ap.add_argument("--archs", metavar="LIST", help=f"CUDA architectures (default {CUDA_ARCHS})")
    ap.add_argument("--bundle", type=Path, metavar="OUT.tar.gz",
                    help="write the patched, pruned source tree as a tarball and exit (scripts/gpu_check)")
    ap.add_argument("--tree", type=Path, metavar="DIR", help="with --wheel-only: build from a --bundle tree")
    args = ap.parse_args(argv)
    try:
        sanitize = parse_sanitize(args.sanitize)
        archs = parse_archs(args.archs)
        if args.bundle is not None:
            write_bundle(args.bundle)
            return 0
        if args.print_key:
            print(make_plan(args.cuda, sanitize=sanitize, archs=archs).key)
            return 0
        if args.tree is not None and not args.wheel_only:
            raise BuildError("--tree builds a wheel only: add --wheel-only")
        if args.wheel_only:
            print(build_only(args.cuda, args.verbose, archs=archs, tree=args.tree))
            return 0
        install(cuda=args.cuda, force=args.force, verbose=args.verbose, sanitize=sanitize, venv=args.venv)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
