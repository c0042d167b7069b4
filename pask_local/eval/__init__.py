"""BFCL evaluation harness behind ``pask-local eval``.

Modules, one job each: ``data`` loads BFCL cases (bundled with the ``bfcl-eval`` package or a user
file), ``split`` assigns each case to the calibration or evaluation split, ``checker`` scores an
output with BFCL's official AST checker, ``reference`` builds known-correct calls from possible
answers, ``prompting`` renders prompts (plain few-shot for base models, chat template for chat
models), ``generator`` holds the Generator protocol and the Full-KV generator with a prefix cache,
``store`` keeps the resumable per-case JSONL, ``runner`` drives a run, ``report`` writes the summary,
markdown table and plot, and ``cli`` is the ``eval`` command.
"""
