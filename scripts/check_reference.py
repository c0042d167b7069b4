#!/usr/bin/env python
"""Print how well the torch reference model agrees with llama.cpp on a GGUF (default: the embedded
Gemma 3 270M): top-1 agreement and KL(llama || reference) over every position of a few prompts,
for the plain float reference and for the reference that reproduces ggml-cpu's roundings. As a
yardstick it also prints how well llama.cpp agrees with itself (one batch vs token-by-token decode:
the same math summed in another order), and the reference's agreement on the positions where
llama.cpp's two runs agree.

    .venv/bin/python scripts/check_reference.py [--gguf PATH] [--numerics] [--prompt TEXT ...]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
from pask_local.calibration.ggml_numerics import GGMLNumerics
from pask_local.calibration.reference import ReferenceModel, log_softmax_kl

from pask_local.errors import PaskError
from pask_local.llm import Context, ContextConfig, Model

DEFAULT_PROMPTS = [
    'You are a helpful assistant with access to functions.\n[{"name": "get_weather", "description": '
    '"Get the current weather for a city", "parameters": {"type": "object", "properties": {"city": '
    '{"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": '
    '["city"]}}]\nUser: What is the weather like in Paris today, in celsius?\nAssistant: {"name": '
    '"get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    'Available tools: [{"name": "book_flight", "parameters": {"origin": "string", "destination": '
    '"string", "date": "string (YYYY-MM-DD)", "passengers": "integer"}}, {"name": "cancel_booking", '
    '"parameters": {"booking_id": "string"}}]\nRequest: I need two seats from Boston to Denver on '
    'March 3rd 2025.\nCall: book_flight(origin="Boston", destination="Denver", date="2025-03-03", '
    'passengers=2)',
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, "
    "printing shops had spread to more than two hundred cities across Europe, and the cost of books "
    "fell sharply. Scholars could now compare identical copies of a text, which changed how knowledge "
    "was checked, corrected and shared.",
]


def llama_run(model: Model, toks: list[int], n_batch: int) -> torch.Tensor:
    """llama.cpp's logits [T, n_vocab] at every position, decoding ``n_batch`` tokens per call."""
    ctx = Context(model, ContextConfig(n_ctx=max(512, len(toks) + 8), n_batch=n_batch))
    rows: list[np.ndarray] = []
    try:
        for s in range(0, len(toks), n_batch):
            chunk = toks[s:s + n_batch]
            if ctx.decode(chunk, s, logits="all") != 0:
                raise PaskError("llama_decode failed")
            rows += [ctx.logits(i) for i in range(len(chunk))]
    finally:
        ctx.close()
    return torch.from_numpy(np.stack(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", help="model file (default: the embedded Gemma 3 270M)")
    ap.add_argument("--prompt", action="append", help="prompt text (repeatable; default: built-in set)")
    ap.add_argument("--numerics", action="store_true", help="only the ggml-numerics reference")
    args = ap.parse_args(argv)
    try:
        if args.gguf:
            path = args.gguf
        else:
            from pask_local.models import default_model_path
            path = str(default_model_path())
        t0 = time.time()
        ref = ReferenceModel.from_gguf(path)
        print(f"reference: {ref} loaded in {time.time() - t0:.1f}s")
        model = Model(path)
        prompts = args.prompt or DEFAULT_PROMPTS
        variants = [("ggml-numerics", GGMLNumerics())] if args.numerics else \
            [("float", None), ("ggml-numerics", GGMLNumerics())]
        llama_logits, stable, self_kl = [], [], []
        for text in prompts:
            toks = model.tokenize(text, add_special=True)
            L = llama_run(model, toks, n_batch=512)        # one batch, as the reference computes
            S = llama_run(model, toks, n_batch=1)          # token by token, as generation decodes
            llama_logits.append((toks, L))
            stable.append(L.argmax(1) == S.argmax(1))
            self_kl.append(log_softmax_kl(L, S))
        st, kl_self = torch.cat(stable), torch.cat(self_kl)
        a_self = st.float()
        print(f"[llama.cpp vs itself] batch vs token-by-token decode, {a_self.numel()} positions: top-1 "
              f"agreement {a_self.mean():.2%}, KL mean {kl_self.mean():.5f} max {kl_self.max():.4f}")
        for name, numerics in variants:
            ref.numerics = numerics
            agree, kls, margins = [], [], []
            for i, (toks, L) in enumerate(llama_logits):
                R = ref.forward(torch.tensor(toks))
                a = (L.argmax(1) == R.argmax(1)).float()
                kl = log_softmax_kl(L, R)
                agree.append(a)
                kls.append(kl)
                top2 = L.topk(2, dim=1).values
                margins.append((top2[:, 0] - top2[:, 1])[a == 0])  # llama.cpp's own top-1/top-2 gap
                print(f"  [{name}] prompt {i}: {len(toks)} tokens, top-1 {a.mean():.2%}, "
                      f"KL mean {kl.mean():.5f} max {kl.max():.4f}")
            a_all, kl_all = torch.cat(agree), torch.cat(kls)
            print(f"[{name}] {a_all.numel()} positions: top-1 agreement {a_all.mean():.2%}, "
                  f"KL(llama||ref) mean {kl_all.mean():.5f} max {kl_all.max():.4f}")
            print(f"[{name}] on the {int(st.sum())} positions where llama.cpp agrees with itself: "
                  f"top-1 agreement {a_all[st].mean():.2%}")
            m = torch.cat(margins)
            if m.numel():
                print(f"[{name}] the {m.numel()} disagreements are near-ties in llama.cpp's own logits: "
                      f"top-1 minus top-2 logit median {m.median():.3f}, max {m.max():.3f}")
    except PaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
