"""Calibration signals on synthetic GGUFs (random weights: fully known models, never accuracy).

Independent checks: the restart shortcut (``forward_from`` from a group's first layer and the first
affected row) must equal the plain full masked forward; the eviction mask must follow the engine's
rule as stated (chunked prefill, generated tokens evicted after decoding), checked position by
position; evicting nothing changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pask_local.calibration.cases import TFCase
from pask_local.calibration.reference import ReferenceInputError, ReferenceModel
from pask_local.calibration.signals import (
    baseline,
    evict_signal,
    eviction_allowed,
    first_affected_row,
    layer_mask,
    measure_case,
    n_cells,
    token_nll,
)
from pask_local.calibration.synthetic import write_synthetic_gguf

from pask_local.classes import StructuralClass as C

N_PROMPT, N_CONT, CHUNK = 72, 18, 16
GROUPS = [[0, 1], [2, 3]]


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def setup(request, tmp_path_factory):
    arch = request.param
    path = write_synthetic_gguf(tmp_path_factory.mktemp("sig") / f"{arch}.gguf", arch=arch, seed=3)
    ref = ReferenceModel.from_gguf(path, device="cpu")
    rng = np.random.default_rng(7)
    T = N_PROMPT + N_CONT
    tokens = rng.integers(3, ref.n_vocab, size=T).tolist()
    prompt_classes = [C.TEMPLATE, C.TOOL_NAME, C.PARAM_NAME, C.DESCRIPTION, C.QUERY]
    classes = [C.SINK] + [prompt_classes[(i // 5) % len(prompt_classes)] for i in range(1, N_PROMPT)]
    gen = [C.GEN_STRUCT, C.GEN_NAME, C.GEN_STRUCT, C.GEN_KEY, C.GEN_VALUE_REQUIRED]
    classes += [gen[i % len(gen)] for i in range(N_CONT)]
    # the query only in the last prompt chunk, as in real prompts
    for i in range(N_PROMPT - 10, N_PROMPT):
        classes[i] = C.QUERY
    for i in range(1, N_PROMPT - 10):
        if classes[i] == C.QUERY:
            classes[i] = C.TEMPLATE
    case = TFCase(tokens=tokens, classes=classes, n_prompt=N_PROMPT, id="synthetic")
    return ref, case, baseline(ref, case)


def expected_allowed(T: int, n_prompt: int, evicted: np.ndarray, chunk: int) -> np.ndarray:
    """The engine rule written out per (query, key) pair."""
    out = np.ones((T, T), dtype=bool)
    for i in range(T):
        for j in range(T):
            if not evicted[j]:
                continue
            if j < n_prompt:
                later_chunk = i >= n_prompt or (i // chunk) > (j // chunk)
                out[i, j] = not later_chunk
            else:
                out[i, j] = not (i > j)
    return out


def test_eviction_mask_follows_the_engine_rule():
    T, n_prompt, chunk = 40, 30, 8
    rng = np.random.default_rng(0)
    for _ in range(5):
        ev = rng.random(T) < 0.3
        got = eviction_allowed(T, n_prompt, ev, chunk).numpy()
        assert (got == expected_allowed(T, n_prompt, ev, chunk)).all()
    ev = np.zeros(T, dtype=bool)
    ev[9] = True                 # prompt key in chunk 1 (rows 8..15)
    ev[33] = True                # generated key
    m = eviction_allowed(T, n_prompt, ev, chunk).numpy()
    assert m[15, 9] and not m[16, 9] and not m[30, 9]          # own chunk sees it, later chunks do not
    assert m[33, 33] and not m[34, 33]                          # decoded, then evicted
    assert first_affected_row(T, n_prompt, ev, chunk) == 16
    ev[9] = False
    assert first_affected_row(T, n_prompt, ev, chunk) == 34
    ev[:] = False
    ev[29] = True                # last prompt chunk: first affected row is the first continuation row
    assert first_affected_row(T, n_prompt, ev, chunk) == 30
    assert eviction_allowed(T, n_prompt, np.zeros(T, dtype=bool), chunk).all()


def test_restart_with_nothing_masked_reproduces_the_trace(setup):
    ref, case, base = setup
    ids = torch.tensor(case.tokens)
    full = ref.forward(ids, logits_rows=base.rows)
    assert torch.allclose(base.trace.logits, full, atol=1e-5)
    for layer in (0, 2, 3):
        for start in (0, 20, N_PROMPT):
            rows = base.rows[base.rows >= start]
            logits, attn = ref.forward_from(layer, base.trace, None, start_row=start, logits_rows=rows,
                                            return_attn_outputs=True)
            assert torch.allclose(logits, full[base.rows >= start], atol=1e-5)
            want = torch.stack([base.trace.attn[il][start:] for il in range(layer, ref.n_layer)])
            assert torch.allclose(attn, want, atol=1e-5)


def test_evicting_nothing_gives_zero_signals(setup):
    ref, case, base = setup
    T = len(case.tokens)
    s = evict_signal(ref, base, np.zeros(T, dtype=bool), [0, 1], CHUNK)
    assert (s.dnll, s.distortion, s.n_evicted) == (0.0, 0.0, 0)


def full_masked_signals(ref, case, base, evicted, layers, chunk):
    """Both signals from the plain full forward with the per-layer mask (no shortcut)."""
    T = len(case.tokens)
    mask = layer_mask(ref.n_layer, layers, eviction_allowed(T, case.n_prompt, evicted, chunk))
    logits, attn = ref.forward(torch.tensor(case.tokens), mask, return_attn_outputs=True)
    nll = token_nll(logits[base.rows], base.targets)
    _, attn0 = ref.forward(torch.tensor(case.tokens), None, return_attn_outputs=True)
    o = attn0[layers][:, base.rows].double()
    o2 = attn[layers][:, base.rows].double()
    rel = float((o2 - o).norm() / o.norm())
    return float(nll.mean() - base.nll.mean()), rel / int(evicted.sum()), logits[base.rows]


@pytest.mark.parametrize("cls", [C.TOOL_NAME, C.DESCRIPTION, C.QUERY, C.GEN_STRUCT, C.GEN_KEY])
def test_shortcut_equals_full_masked_forward(setup, cls):
    ref, case, base = setup
    ev = np.array([c == cls for c in case.classes])
    for layers in GROUPS + [[0, 1, 2, 3]]:
        s = evict_signal(ref, base, ev, layers, CHUNK)
        dnll, dist, _ = full_masked_signals(ref, case, base, ev, layers, CHUNK)
        assert s.n_evicted == int(ev.sum())
        assert s.dnll == pytest.approx(dnll, abs=1e-5)
        assert s.distortion == pytest.approx(dist, rel=1e-4, abs=1e-8)
        assert s.distortion > 0          # the synthetic model's peaked attention sees every eviction


def test_rows_before_the_first_affected_row_are_unchanged(setup):
    ref, case, base = setup
    T = len(case.tokens)
    ev = np.zeros(T, dtype=bool)
    ev[[20, 21, 40]] = True     # chunk 1 (rows 16..31) and chunk 2
    mask = layer_mask(ref.n_layer, [0, 1, 2, 3], eviction_allowed(T, case.n_prompt, ev, CHUNK))
    ids = torch.tensor(case.tokens)
    a = ref.forward(ids)
    b = ref.forward(ids, mask)
    first = first_affected_row(T, case.n_prompt, ev, CHUNK)
    assert first == 32
    assert torch.allclose(a[:first], b[:first], atol=1e-6)
    assert (b[first] - a[first]).abs().max() > 1e-3     # the first affected row does change


def test_measure_case_covers_every_present_class_and_group(setup):
    ref, case, _ = setup
    calls = []
    sig = measure_case(ref, case, GROUPS, chunk=CHUNK, on_cell=lambda: calls.append(1))
    present = {c.value for c in case.classes} - {"sink"}
    assert {(x["group"], x["class"]) for x in sig.cells} == {(g, c) for g in range(2) for c in present}
    assert {x["class"] for x in sig.joint} == present
    assert len(calls) == n_cells(case, 2) == len(sig.cells) + len(sig.joint)
    # a joint cell is the single-group eviction applied to every group at once
    for j in sig.joint:
        ev = np.array([c.value == j["class"] for c in case.classes])
        assert j["dnll"] == pytest.approx(evict_signal(ref, baseline(ref, case), ev, range(ref.n_layer), CHUNK).dnll)
    assert sig.counts["sink"] == 1 and sum(sig.counts.values()) == len(case.tokens)
    assert sig.base_nll == pytest.approx(float(baseline(ref, case).nll.mean()))


def test_forward_from_rejects_bad_arguments(setup):
    ref, case, base = setup
    with pytest.raises(ReferenceInputError):
        ref.forward_from(ref.n_layer, base.trace)
    with pytest.raises(ReferenceInputError):
        ref.forward_from(0, base.trace, start_row=len(case.tokens))
    with pytest.raises(ReferenceInputError):
        ref.forward_from(0, base.trace, start_row=10, logits_rows=torch.tensor([5]))
