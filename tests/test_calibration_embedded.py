"""The sensitivity signal on the embedded Gemma 3 270M is not noise: on the same calib cases,
evicting the user's query or the parameter names in every layer raises the gold call's NLL far
more than evicting the (larger) tool descriptions. Also: the shipped calibrated policy is the
default for this model, and any other model gets the hand-written prior with a notice (never a
policy calibrated on another model)."""

from __future__ import annotations

import numpy as np
import pytest
from pask_local.calibration.cases import build_case
from pask_local.calibration.cli import calib_cases
from pask_local.calibration.reference import ReferenceModel
from pask_local.calibration.signals import baseline, evict_signal
from pask_local.calibration.synthetic import write_synthetic_gguf

from pask_local.classes import StructuralClass as C
from pask_local.llm import Model
from pask_local.models import file_sha256
from pask_local.policy.handwritten import handwritten_policy
from pask_local.policy.shipped import resolve_default_policy, shipped_policies

N_CASES = 3


@pytest.mark.slow
def test_query_and_param_names_matter_more_than_descriptions(gemma_path):
    import torch

    torch.set_num_threads(1)
    model = Model(gemma_path)
    ref = ReferenceModel.from_gguf(gemma_path, device="cpu")
    cases = [build_case(model, c) for c in calib_cases(["simple_python"])[:N_CASES]]
    all_layers = list(range(ref.n_layer))
    got: dict[str, list[float]] = {"query": [], "param names": [], "description": []}
    for case in cases:
        base = baseline(ref, case)
        cls = np.array([c.value for c in case.classes])
        sets = {"query": cls == C.QUERY.value,
                "param names": (cls == C.PARAM_NAME.value) | (cls == C.PARAM_REQUIRED.value),
                "description": cls == C.DESCRIPTION.value}
        assert all(s.any() for s in sets.values()), case.id
        for name, ev in sets.items():
            got[name].append(evict_signal(ref, base, ev, all_layers).dnll)
    mean = {k: float(np.mean(v)) for k, v in got.items()}
    print("\ndNLL (nats/token) per case", [c.id for c in cases], got)
    # measured (3 simple_python calib cases): query 0.33, param names 0.27, description 0.04
    assert mean["query"] > 0.15 and mean["param names"] > 0.15
    assert mean["query"] > 4 * max(mean["description"], 0.01)
    assert mean["param names"] > 4 * max(mean["description"], 0.01)
    # per case too, not only on average
    for q, p, d in zip(got["query"], got["param names"], got["description"], strict=True):
        assert q > d and p > d


def test_shipped_policy_is_calibrated_for_the_embedded_model(gemma_path):
    # matched by content (the cache file's name may change; the default policy is resolved by sha256 too)
    mine = [p for p in shipped_policies() if p.provenance.get("model_sha256") == file_sha256(gemma_path)]
    assert len(mine) == 1
    pol = mine[0]
    assert pol.kind == "calibrated" and pol.provenance["split"] == "calib" and pol.provenance["n_cases"] >= 8
    assert pol.provenance["model_sha256"] == file_sha256(gemma_path)
    model = Model(gemma_path)
    chosen, warning = resolve_default_policy(model)
    assert warning is None and chosen.kind == "calibrated" and chosen.floors == pol.floors


@pytest.mark.parametrize("arch, n_layer", [("gemma3", 6), ("qwen3", 4), ("gemma3", 18)])
def test_other_models_get_the_prior_with_a_notice(tmp_path, arch, n_layer):
    # never a policy calibrated on another model, even of the same architecture and depth
    path = write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch=arch, n_layer=n_layer, seed=2)
    chosen, warning = resolve_default_policy(Model(path))
    assert chosen.kind == "hand-written" and chosen.n_layer == n_layer
    assert warning and "hand-written prior" in warning and path.name in warning
    assert chosen.floors == handwritten_policy(n_layer).floors
    chosen.check_model(n_layer)


def test_shipped_qwen_policy_is_calibrated_and_splits_the_budget_by_group():
    # the policy shipped for Qwen2.5-Coder-1.5B (matched by the registry's sha256 of its joined GGUF):
    # fitted from >= 100 calib cases, with measured group curves and no group below half the budget
    from pask_local.model_registry import MODELS
    from pask_local.policy import compile_policy

    sha = MODELS["qwen2.5-coder-1.5b"].sha256
    mine = [p for p in shipped_policies() if p.provenance.get("model_sha256") == sha]
    assert len(mine) == 1
    pol = mine[0]
    assert pol.kind == "calibrated" and pol.n_layer == 28 and pol.provenance["split"] == "calib"
    assert pol.provenance["n_cases"] >= 100 and pol.group_budget is not None
    assert pol.group_budget.min_share == 0.5
    counts = {C.SINK: 1, C.TEMPLATE: 60, C.TOOL_NAME: 4, C.PARAM_REQUIRED: 6, C.PARAM_TYPE: 8,
              C.DESCRIPTION: 50, C.SCHEMA_PUNCT: 70, C.QUERY: 20}
    for budget in (0.33, 0.2, 0.1):
        out = compile_policy(pol, budget, counts)
        assert out.granted_entries <= budget * out.full_entries * 1.02
        n = sum(counts.values())
        for layers in pol.groups:
            # every layer of a group holds at least half the budget's share of the prompt
            assert min(out.layer_capacity[il] for il in layers) >= 0.5 * budget * n - 1
        # the later groups (the sensitive ones, by the curves) get more than the first
        assert out.layer_capacity[-1] > out.layer_capacity[0]
