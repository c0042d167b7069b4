"""Layered KV cache (patch 0002): capacity is real memory, not a mask.

Two fresh processes create the same synthetic Qwen3 context with a large KV cache, one at full
capacity and one at 1/3 of it; the reported K/V bytes must be ~1/3 and the peak RSS difference must
show most of the saved bytes (the KV buffers are zero-filled at creation, so their pages are touched).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kv_layered_helpers import synthetic

N_CTX = 24576
CHILD = r"""
import json, sys
from pask_local.llm import ContextConfig, Model
from pask_local.kv_layered import LayeredContext
path, cap = sys.argv[1], int(sys.argv[2])
m = Model(path)
ctx = LayeredContext(m, [cap] * m.n_layer, ContextConfig(n_ctx=cap, n_batch=32, n_threads=1))
assert ctx.decode([300, 301, 302], 0) == 0
# VmHWM: this process image's peak RSS (ru_maxrss would carry the parent's peak across exec)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"kv_bytes": ctx.kv_bytes(), "maxrss_kib": hwm}))
"""


def _child(path, cap: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(cap)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_one_third_capacity_allocates_one_third_and_lowers_peak_rss(tmp_path) -> None:
    fraction = 3
    path = synthetic(tmp_path, "qwen3", n_layer=4, n_head=8, n_head_kv=8, head_dim=64, n_ctx=N_CTX)
    full = _child(path, N_CTX)
    part = _child(path, N_CTX // fraction)
    ratio = part["kv_bytes"] / full["kv_bytes"]
    saved = full["kv_bytes"] - part["kv_bytes"]
    rss_diff = (full["maxrss_kib"] - part["maxrss_kib"]) * 1024
    print(f"K/V bytes full {full['kv_bytes'] / 2**20:.1f} MiB, 1/{fraction} {part['kv_bytes'] / 2**20:.1f} MiB "
          f"(ratio {ratio:.3f}); peak RSS full {full['maxrss_kib'] / 1024:.1f} MiB, "
          f"1/{fraction} {part['maxrss_kib'] / 1024:.1f} MiB, difference {rss_diff / 2**20:.1f} MiB "
          f"(K/V bytes saved {saved / 2**20:.1f} MiB)")
    assert ratio == pytest.approx(1 / fraction, abs=0.01)
    assert rss_diff > 0.8 * saved
