"""calibration/native_signals.py: the NLL increase measured by llama.cpp (one prefill, forked cells)
equals the torch reference's with one prefill chunk as long as the prompt, on F32 synthetic GGUFs
(where the reference matches llama.cpp's numerics), for per-group, joint and budget-aware cells."""

from __future__ import annotations

import numpy as np
import pytest
from pask_local.calibration.cases import TFCase
from pask_local.calibration.ggml_numerics import GGMLNumerics
from pask_local.calibration.native_signals import NativeCase, measure_case_native, span_tail_positions
from pask_local.calibration.reference import ReferenceModel
from pask_local.calibration.signals import baseline, evict_signal
from pask_local.calibration.synthetic import write_synthetic_gguf

from pask_local.classes import StructuralClass as C
from pask_local.errors import PaskError
from pask_local.llm import Model

N_PROMPT, N_CONT = 80, 14
GROUPS = [[0, 1], [2, 3]]


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def setup(request, tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("nsig") / f"{request.param}.gguf", arch=request.param,
                                seed=5)
    # with llama.cpp-CPU roundings (its F16 KV cache above all): the signals are small differences
    ref = ReferenceModel.from_gguf(path, device="cpu", numerics=GGMLNumerics())
    model = Model(path)
    rng = np.random.default_rng(11)
    tokens = rng.integers(3, ref.n_vocab, size=N_PROMPT + N_CONT).tolist()
    kinds = [C.TEMPLATE, C.TOOL_NAME, C.PARAM_NAME, C.DESCRIPTION, C.QUERY]
    classes = [C.SINK] + [kinds[(i // 6) % len(kinds)] for i in range(1, N_PROMPT)]
    gen = [C.GEN_STRUCT, C.GEN_NAME, C.GEN_KEY, C.GEN_VALUE_REQUIRED]
    classes += [gen[i % len(gen)] for i in range(N_CONT)]
    case = TFCase(tokens=tokens, classes=classes, n_prompt=N_PROMPT, id="synthetic")
    yield ref, model, case
    model.close()


def test_span_tails():
    cls = [C.SINK, C.QUERY, C.QUERY, C.QUERY, C.TEMPLATE, C.QUERY, C.QUERY, C.GEN_NAME]
    assert span_tail_positions(cls, C.QUERY, 7) == [1, 2, 3, 5, 6]
    assert span_tail_positions(cls, C.QUERY, 7, keep=0.5) == [3, 6]   # ceil(1.5) = 2 of 3 kept, 1 of 2
    assert span_tail_positions(cls, C.QUERY, 7, keep=1.0) == []
    with pytest.raises(PaskError):
        span_tail_positions(cls, C.QUERY, 7, keep=1.5)


def test_native_dnll_equals_the_reference_with_one_prompt_chunk(setup):
    ref, model, case = setup
    base = baseline(ref, case)
    nc = NativeCase.open(model, case)
    try:
        assert nc.base_nll == pytest.approx(base.mean_nll, rel=1e-3, abs=1e-4)
        checked = 0
        pairs: list[tuple[float, float]] = []
        for c in (C.TOOL_NAME, C.QUERY, C.DESCRIPTION):
            for keep in (0.0, 0.5):
                pos = span_tail_positions(case.classes, c, case.n_prompt, keep)
                ev = np.zeros(len(case.tokens), dtype=bool)
                ev[pos] = True
                for layers in (*GROUPS, range(ref.n_layer)):
                    want = evict_signal(ref, base, ev, list(layers), chunk=case.n_prompt).dnll
                    got = nc.dnll(pos, layers)
                    # measured: |native - reference| <= 4e-4 nats/token for signals of 0.01-0.3
                    assert got == pytest.approx(want, rel=1e-2, abs=6e-4), (c, keep, list(layers))
                    pairs.append((want, got))
                    checked += abs(want) > 1e-2
            # the fork leaves sequence 0 whole: the prompt is still held in every layer
            assert all(nc.ctx.used(il, 0) == case.n_prompt for il in range(ref.n_layer))
            assert all(nc.ctx.used(il, 1) == 0 for il in range(ref.n_layer))
        assert checked >= 6  # the comparison is not between zeros
        # what a fit reads is the order of the cells: every pair the reference separates by more than
        # 2e-3 nats/token is in the same order natively
        for a_ref, a_nat in pairs:
            for b_ref, b_nat in pairs:
                if a_ref > b_ref + 2e-3:
                    assert a_nat > b_nat
    finally:
        nc.close()


def test_record_has_every_prompt_cell_and_no_generated_class(setup):
    _, model, case = setup
    n = 0

    def tick() -> None:
        nonlocal n
        n += 1

    rec = measure_case_native(model, case, GROUPS, keep=0.2, on_cell=tick)
    prompt = {C.TEMPLATE.value, C.TOOL_NAME.value, C.PARAM_NAME.value, C.DESCRIPTION.value, C.QUERY.value}
    assert {c["class"] for c in rec["cells"]} == prompt == {j["class"] for j in rec["joint"]}
    assert len(rec["cells"]) == len(prompt) * len(GROUPS) and n == len(prompt) * (len(GROUPS) + 1)
    assert rec["keep"] == 0.2 and rec["signal"] == "native"
    q = next(j for j in rec["joint"] if j["class"] == C.QUERY.value)
    assert q["n_evicted"] == len(span_tail_positions(case.classes, C.QUERY, case.n_prompt, 0.2)) > 0
