"""PASKPress (pask_local.kvpress) against pask-local itself, on the real Qwen2.5-Coder-0.5B GGUF.

Needs the optional extra (kvpress, transformers): skipped without it, since CI installs the default
extras only. The slow tests compare the press with pask-local's own engine run (the layered cache's
held positions after the planned prefill), and run the press in a transformers forward pass of the
same GGUF loaded with ``gguf_file=``.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("kvpress")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

import torch  # noqa: E402

from pask_local.classes import StructuralClass  # noqa: E402
from pask_local.engine import Engine, EngineConfig  # noqa: E402
from pask_local.errors import PaskError  # noqa: E402
from pask_local.eval.prompting import make_task, task_plan  # noqa: E402
from pask_local.eval.runner import EvalConfig, select_cases  # noqa: E402
from pask_local.kvpress import HFVocab, PASKPress, gguf_tokenizer  # noqa: E402
from pask_local.methods import registry  # noqa: E402
from pask_local.policy.handwritten import handwritten_policy  # noqa: E402

BUDGET = 0.33
# 10 BFCL prompts of the eval split: the first 2 of each of 5 categories (tool lists of 1 to 4 functions)
CATEGORIES = ["simple_python", "multiple", "parallel", "parallel_multiple", "live_simple"]


def test_budget_is_one_minus_ratio_without_float_residue():
    assert PASKPress(compression_ratio=1 - BUDGET).budget == BUDGET  # 1 - 0.67 is 0.32999999999999996
    with pytest.raises(ValueError):
        PASKPress(compression_ratio=1.0)


def test_attention_ordered_policy_is_refused():
    pol = handwritten_policy(24)
    pol.within_class_order = "attention"
    press = PASKPress(compression_ratio=0.5, policy=pol).bind([StructuralClass.QUERY] * 8)
    with pytest.raises(PaskError, match="attention"):
        press.keep_sets(24)


def test_bind_checks_lengths():
    with pytest.raises(PaskError):
        PASKPress(compression_ratio=0.5).bind([StructuralClass.QUERY] * 3, tokens=[1, 2])


@pytest.fixture(scope="module")
def hf_tokenizer(qwen05_path):
    return gguf_tokenizer(qwen05_path)


@pytest.fixture(scope="module")
def cases():
    from pask_local.models import named_model_path

    found = select_cases(EvalConfig(gguf=named_model_path("qwen2.5-coder-0.5b"), out=None,
                                    categories=CATEGORIES, limit=2))
    assert len(found) == 10
    return found


def _engine_prefill(model, case):
    """pask-local's own run of ``case`` with its default method at BUDGET, driven through the prefill:
    (its prompt, its plan's capacities, the positions each layer of the layered cache holds)."""
    engine = Engine(model, registry.make(registry.DEFAULT_METHOD, model), EngineConfig(budget=BUDGET))
    task = make_task(case)
    prepared = engine.prepare(task.conversation(), task.functions, "required", task.parallel, task.examples)
    run = engine.new_run(prepared)
    try:
        run.begin(prepared.plan, prepared.request)
        tokens = run.prompt.tokens
        for a, b in run.prefill_bounds():
            assert run.stream.ctx.decode(tokens[a:b], a) == 0
            run.after_chunk(a, b)
        run.end_prefill()
        held = [np.sort(run.stream.held(il)) for il in range(model.n_layer)]
        return prepared.plan.prompt, list(run.caps), held
    finally:
        run.close()


@pytest.mark.slow
def test_press_keeps_what_the_engine_keeps_on_10_bfcl_prompts(qwen05_model, hf_tokenizer, cases):
    # the press's default policy is the one pask-local's default method runs
    assert registry.get(registry.DEFAULT_METHOD).variant.policy == "prior"
    vocab = HFVocab(hf_tokenizer)
    bounds = EngineConfig()
    n_layer = qwen05_model.n_layer
    for case in cases:
        prompt, caps, held = _engine_prefill(qwen05_model, case)
        # tagged on the HF tokenizer by pask-local's renderer: the same tokens and classes as on the GGUF
        hf = task_plan(vocab, make_task(case), "auto", bounds.max_string, bounds.max_calls).prompt
        assert hf.tokens == prompt.tokens, case.id
        assert hf.classes == prompt.classes, case.id
        press = PASKPress(compression_ratio=1 - BUDGET).bind(hf.classes, hf.tokens)
        keep = press.keep_sets(n_layer)
        for il in range(n_layer):
            assert keep[il] is not None
            assert len(held[il]) == caps[il] < len(prompt.tokens), (case.id, il)
            np.testing.assert_array_equal(keep[il], held[il], err_msg=f"{case.id} layer {il}")


@pytest.mark.slow
def test_press_in_a_transformers_prefill_holds_the_plan(qwen05_path, qwen05_model, hf_tokenizer, cases):
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(qwen05_path.parent), gguf_file=qwen05_path.name,
                                                 dtype=torch.float32)
    model.eval()
    case = cases[2]  # a multiple-tools prompt
    bounds = EngineConfig()
    prompt = task_plan(HFVocab(hf_tokenizer), make_task(case), "auto", bounds.max_string, bounds.max_calls).prompt
    ids = torch.tensor([prompt.tokens])
    press = PASKPress(compression_ratio=1 - BUDGET).bind(prompt.classes, prompt.tokens)
    expected = press.keep_sets(model.config.num_hidden_layers)
    from pask_local.methods.pask import class_indices

    caps = registry.make(registry.DEFAULT_METHOD, qwen05_model).bind(BUDGET, class_indices(prompt.classes),
                                                                     qwen05_model.n_layer).capacities
    with torch.no_grad():
        full = DynamicCache()
        model(input_ids=ids, past_key_values=full)
        cache = DynamicCache()
        with press(model):
            out = model(input_ids=ids, past_key_values=cache)
        for il, layer in enumerate(cache.layers):
            assert layer.keys.shape[2] == layer.values.shape[2] == len(expected[il]) == caps[il], il
            idx = torch.as_tensor(expected[il])
            # the kept entries are the whole prefill's entries at the planned positions, untouched
            assert torch.equal(layer.keys, full.layers[il].keys[:, :, idx]), il
            assert torch.equal(layer.values, full.layers[il].values[:, :, idx]), il
        # the compressed cache decodes: the next position continues the prompt's
        step = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache,
                     position_ids=torch.tensor([[len(prompt.tokens)]]))
        assert torch.isfinite(step.logits).all()
        assert cache.layers[0].keys.shape[2] == caps[0] + 1
        # a press bound to other tokens refuses the prefill instead of keeping meaningless positions
        wrong = PASKPress(compression_ratio=1 - BUDGET).bind(prompt.classes, [0] * len(prompt.tokens))
        with pytest.raises(PaskError, match="token ids"), wrong(model):
            model(input_ids=ids, past_key_values=DynamicCache())
