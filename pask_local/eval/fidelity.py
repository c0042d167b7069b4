"""The fidelity metric of ``pask-local eval --fidelity``: how closely a method tracks Full KV, per step.

For a case, Full KV's reference (``Reference``) is its own greedy output through the engine's
``full`` path plus, at every step, its distribution (``forced.RefStep``: top-K log-probs and the
rest's mass), and the gold call's per-token log-probs under Full KV. It is computed once per case
and stored in ``--out/fidelity_ref/`` or ``--fidelity-refs`` (``ReferenceStore``), so every method
of a run (and a rerun, and other runs given the same directory) reuses it. Each method is then teacher-forced (``forced.ForcedDecoder``) along Full KV's tokens on
its normal engine path, which gives per step KL(Full || method) and top-1 agreement (the method's
own constrained greedy choice == Full KV's token), and along the gold call, which gives its NLL.

Steps are grouped by the generated token's structural class (``GROUPS``: function name, argument
key, value, punctuation/whitespace; ``end`` is an end-of-generation step). A case's record holds,
per group and overall, the step count and the mean KL and agreement; ``pool`` merges records
token-weighted. The gold call is the BFCL reference answer rendered as the grammar emits it
(``eval.gold.gold_call_text``), wrapped in the native call blocks for native prompts.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..classes import StructuralClass as C
from ..errors import PaskError
from ..llm import Model
from .data import Case
from .forced import TOP_K, ForcedDecoder, RefStep, StepStat
from .gold import plan_gold_text
from .prompting import ENGINE_STYLES, Task, make_task, task_plan
from .reference import reference_calls, unsatisfiable

REF_DIR = "fidelity_ref"
SETTINGS_FILE = "settings.json"  # what the references depend on (ReferenceStore)
GROUPS: dict[str, tuple[C, ...]] = {
    "name": (C.GEN_NAME,),
    "key": (C.GEN_KEY,),
    "value": (C.GEN_VALUE_REQUIRED, C.GEN_VALUE_OPTIONAL),
    "punct": (C.GEN_STRUCT, C.GEN_WS),
}
END = "end"
GROUP_NAMES: tuple[str, ...] = (*GROUPS, END)
_GROUP_OF = {c: g for g, cs in GROUPS.items() for c in cs}


def group_of(cls: C | None) -> str:
    """The report group of a generated class (None, an end-of-generation step: ``end``)."""
    if cls is None:
        return END
    return _GROUP_OF.get(cls, "value")  # text outside a call (gen_value_optional) is already "value"


@dataclass
class Reference:
    """Full KV's run of one case: the forced steps, its distribution at each, the gold call's log-probs."""

    tokens: list[int]             # every step's token (generated tokens, then the end token if it stopped on one)
    classes: list[str]            # each step's class value ("" for the end token)
    steps: list[RefStep]
    gold: list[int]               # the gold call's tokens ([] when unavailable)
    gold_lp: list[float]          # Full KV's log-prob of each gold token forced
    gold_error: str | None = None

    def save(self, path: Path) -> None:
        k = max((len(s.ids) for s in self.steps), default=0)
        ids = np.zeros((len(self.steps), k), dtype=np.int64)
        lps = np.full((len(self.steps), k), -np.inf)
        for i, s in enumerate(self.steps):
            ids[i, :len(s.ids)], lps[i, :len(s.lp)] = s.ids, s.lp
        meta = {"classes": self.classes, "gold_error": self.gold_error, "top_k": TOP_K}
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")  # processes sharing --out may race
        np.savez_compressed(tmp, tokens=np.asarray(self.tokens, dtype=np.int64), ids=ids, lp=lps,
                            rest=np.asarray([s.rest for s in self.steps], dtype=np.float64),
                            gold=np.asarray(self.gold, dtype=np.int64), gold_lp=np.asarray(self.gold_lp),
                            meta=np.asarray(json.dumps(meta)))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Reference | None:
        """The stored reference, or None when absent, unreadable or made with another TOP_K."""
        try:
            with np.load(path) as z:
                meta = json.loads(str(z["meta"]))
                if meta.get("top_k") != TOP_K:
                    return None
                steps = [RefStep(ids=z["ids"][i][np.isfinite(z["lp"][i])], lp=z["lp"][i][np.isfinite(z["lp"][i])],
                                 rest=float(z["rest"][i])) for i in range(len(z["tokens"]))]
                return cls([int(t) for t in z["tokens"]], list(meta["classes"]), steps,
                           [int(t) for t in z["gold"]], [float(x) for x in z["gold_lp"]], meta.get("gold_error"))
        except (OSError, ValueError, KeyError, json.JSONDecodeError):
            return None


def forced_run(engine: Any, task: Task, forced: Sequence[int] | None = None,
               ref: Sequence[RefStep] | None = None, keep_top: int = 0) -> tuple[Any, ForcedDecoder]:
    """Run ``task`` on ``engine``'s model, method and config with a ``ForcedDecoder``; (result, decoder)."""
    from ..engine import Engine

    made: list[ForcedDecoder] = []

    def factory(model: Model, plan: Any, sampling: Any = None) -> ForcedDecoder:  # forced: always greedy
        made.append(ForcedDecoder(model, plan, forced, ref, keep_top))
        return made[-1]

    forced_engine = Engine(engine.model, engine.method, engine.cfg, decoder_factory=factory)
    res = forced_engine.chat(task.conversation(), task.functions, "required", parallel=task.parallel,
                             examples=task.examples)
    return res, made[-1]


def gold_text(plan: Any, task: Task, case: Case) -> str:
    """The case's gold call as the plan's grammar emits it (PaskError when there is none)."""
    if case.answer is None:
        raise PaskError("no possible answer")
    why = unsatisfiable(task.functions, case.answer)
    if why:
        raise PaskError(f"unsatisfiable answer: {why}")
    return plan_gold_text(plan, reference_calls(task.functions, case.answer), task.parallel)


def gold_tokens(engine: Any, task: Task, case: Case) -> list[int]:
    """The gold call's tokens for this case's prompt style (PaskError when there is no usable gold)."""
    plan = task_plan(engine.model, task, _style(engine), engine.cfg.max_string, engine.cfg.max_calls)
    text = gold_text(plan, task, case)
    return engine.model.tokenize(text, add_special=False, parse_special=plan.fmt is not None)


def _style(engine: Any) -> str:
    # the engine's style name -> the harness's (task_plan maps it back): ENGINE_STYLES inverted
    return {v: k for k, v in ENGINE_STYLES.items()}.get(engine.cfg.style, engine.cfg.style)


def _gold_lps(dec: ForcedDecoder, gold: list[int]) -> tuple[list[float], str | None]:
    lps = [s.lp for s in dec.steps]
    if dec.failed:
        return [], dec.failed
    if len(lps) < len(gold):
        return lps, f"the grammar ended (or max_tokens) after {len(lps)} of {len(gold)} gold tokens"
    return lps, None


def compute_reference(full_engine: Any, case: Case, task: Task) -> Reference:
    """Full KV's greedy run of ``case`` with its top-K per step, and the gold call forced."""
    res, dec = forced_run(full_engine, task, keep_top=TOP_K)
    classes = [s.cls.value if s.cls is not None else "" for s in dec.steps]
    assert [s.token for s in dec.steps[:len(res.tokens)]] == list(res.tokens)
    gold: list[int] = []
    gold_lp: list[float] = []
    error = None
    try:
        gold = gold_tokens(full_engine, task, case)
        _, gdec = forced_run(full_engine, task, forced=gold)
        gold_lp, error = _gold_lps(gdec, gold)
    except PaskError as exc:
        error = str(exc)
    if error:
        gold, gold_lp = [], []
    return Reference([s.token for s in dec.steps], classes, dec.tops, gold, gold_lp, error)


def _safe_name(case_id: str) -> str:
    digest = hashlib.sha256(case_id.encode()).hexdigest()[:12]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", case_id)[:80] + "-" + digest + ".npz"


def _read_settings(path: Path) -> dict[str, Any] | None:
    """A reference directory's recorded settings; None when it has none (PaskError when unreadable)."""
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError):
        old = None
    if not isinstance(old, dict):
        raise PaskError(f"{path} is unreadable: use another --fidelity-refs directory")
    return old


class ReferenceStore:
    """Full KV's references in one directory, one ``.npz`` per case, computed on first use.

    Several processes may share the directory (``pask-local eval --fidelity-refs``, the study's
    jobs): a case's reference is computed under an exclusive lock on its ``.lock`` file, so the
    process that comes second waits and loads it instead of computing it again.
    """

    def __init__(self, ref_dir: Path, settings: dict[str, Any] | None = None) -> None:
        self.dir = ref_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.computed = 0  # references this process computed
        self.loaded = 0    # and the ones it found made (by an earlier run or another process)
        if settings is not None:
            self._check_settings(settings)

    def _check_settings(self, settings: dict[str, Any]) -> None:
        """Refuse a directory whose references were made with other settings; record them otherwise."""
        path = self.dir / SETTINGS_FILE
        old = _read_settings(path)
        if old is not None:
            diff = sorted(k for k in old.keys() | settings.keys() if old.get(k) != settings.get(k))
            if diff:
                raise PaskError(f"{self.dir} holds Full KV references made with other settings "
                                f"({', '.join(diff)}): use another --fidelity-refs directory")
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")
        tmp.replace(path)

    def get(self, case: Case, task: Task, full_engine_of: Any) -> Reference:
        path = self.dir / _safe_name(case.id)
        ref = Reference.load(path) if path.exists() else None
        if ref is None:
            with open(path.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                ref = Reference.load(path) if path.exists() else None  # made while this process waited
                if ref is None:
                    ref = compute_reference(full_engine_of(), case, task)
                    ref.save(path)
                    self.computed += 1
                    return ref
        self.loaded += 1
        return ref


def summarize_steps(steps: Sequence[StepStat], ref_tokens: Sequence[int]) -> dict[str, Any]:
    """Per group and overall: step count, mean KL, top-1 agreement with Full KV's tokens."""
    acc: dict[str, list[float]] = {g: [0, 0.0, 0] for g in GROUP_NAMES}
    for s, ref_tok in zip(steps, ref_tokens, strict=False):
        a = acc[group_of(s.cls)]
        a[0] += 1
        a[1] += s.kl or 0.0
        a[2] += s.own == ref_tok
    groups = {g: _means(*a) for g, a in acc.items() if a[0]}
    n = sum(a[0] for a in acc.values())
    return {**_means(n, sum(a[1] for a in acc.values()), sum(a[2] for a in acc.values())), "groups": groups}


def _means(n: float, kl: float, top1: float) -> dict[str, Any]:
    return {"n": int(n), "kl": kl / n if n else None, "top1": top1 / n if n else None}


def _nll(lps: Sequence[float]) -> float | None:
    return -sum(lps) / len(lps) if lps else None


def _gold_fields(ref: Reference, lps: Sequence[float] | None, error: str | None) -> dict[str, Any]:
    error = ref.gold_error or error
    ok = error is None and lps is not None and len(lps) == len(ref.gold)
    return {"gold_n": len(ref.gold) if ok else 0, "gold_nll": _nll(lps) if ok and lps else None,
            "gold_nll_full": _nll(ref.gold_lp) if ok else None, "gold_error": error if not ok else None}


def reference_fidelity(ref: Reference) -> dict[str, Any]:
    """Full KV's own record: KL 0 and agreement 1 by definition, its gold NLL."""
    steps = [StepStat(token=t, own=t, lp=0.0, kl=0.0, cls=C(c) if c else None)
             for t, c in zip(ref.tokens, ref.classes, strict=True)]
    return {**summarize_steps(steps, ref.tokens), **_gold_fields(ref, ref.gold_lp, None)}


def method_fidelity(engine: Any, case: Case, task: Task, ref: Reference) -> dict[str, Any]:
    """Teacher-force ``engine``'s method along Full KV's tokens and the gold call; the record field."""
    res, dec = forced_run(engine, task, forced=ref.tokens, ref=ref.steps)
    out = summarize_steps(dec.steps, ref.tokens)
    out["same_tokens"] = [s.token for s in dec.steps] == ref.tokens and dec.failed is None
    lps: list[float] | None = None
    error = None
    if ref.gold:
        _, gdec = forced_run(engine, task, forced=ref.gold)
        lps, error = _gold_lps(gdec, ref.gold)
    return {**out, **_gold_fields(ref, lps, error)}


class FidelityMeter:
    """Measures one case's fidelity for a generator of the run (``rec["fidelity"]``)."""

    def __init__(self, ref_dir: Path, use_examples: bool = True, settings: dict[str, Any] | None = None) -> None:
        self.refs = ReferenceStore(ref_dir, settings)
        self.use_examples = use_examples

    def measure(self, case: Case, gen: Any, raw_output: str | None = None) -> dict[str, Any]:
        """``rec["fidelity"]`` of ``gen``'s run on ``case``; ``raw_output``: the text ``gen`` generated
        (for Full KV: ``same_output`` says whether the reference's text is the same)."""
        from ..engine import Engine, make_method

        task = make_task(case, self.use_examples)
        engine = getattr(gen, "engine", None)
        model = gen.model
        cfg = engine.cfg if engine is not None else gen.spec.engine_config(1.0)

        def full_engine() -> Any:
            return Engine(model, make_method("full", model), dataclasses.replace(cfg, budget=1.0))

        try:
            ref = self.refs.get(case, task, full_engine)
            if engine is None:
                fid = reference_fidelity(ref)
                if raw_output is not None:
                    text = model.detokenize([t for t in ref.tokens if not model.is_eog(t)], special=True)
                    fid["same_output"] = text == raw_output
                return fid
            return method_fidelity(engine, case, task, ref)
        except PaskError as exc:
            return {"n": 0, "kl": None, "top1": None, "groups": {}, "error": f"{type(exc).__name__}: {exc}"}


def pool(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Token-weighted fidelity over the records' ``fidelity`` fields; None when none has one."""
    fids = [r["fidelity"] for r in records if r.get("fidelity")]
    if not fids:
        return None
    out: dict[str, Any] = {"cases": len(fids), "groups": {}}
    for g in (None, *GROUP_NAMES):
        parts = [f if g is None else f.get("groups", {}).get(g) for f in fids]
        parts = [p for p in parts if p and p.get("n")]
        n = sum(p["n"] for p in parts)
        m = {"n": n, "kl": sum(p["n"] * p["kl"] for p in parts) / n if n else None,
             "top1": sum(p["n"] * p["top1"] for p in parts) / n if n else None}
        if g is None:
            out.update(m)
        elif n:
            out["groups"][g] = m
    gold = [f for f in fids if f.get("gold_n")]
    n_gold = sum(f["gold_n"] for f in gold)
    same = [f["same_output"] for f in fids if "same_output" in f]
    out["same_output"] = sum(same) / len(same) if same else None  # Full KV: reference text == its record's
    out["gold_cases"] = len(gold)
    out["gold_nll"] = sum(f["gold_n"] * f["gold_nll"] for f in gold) / n_gold if n_gold else None
    full = sum(f["gold_n"] * f["gold_nll_full"] for f in gold) / n_gold if n_gold else None
    out["gold_dnll"] = out["gold_nll"] - full if full is not None and out["gold_nll"] is not None else None
    return out
