"""scripts/profile_phases.py: parsing perf's report, and a real perf recording split by time window."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_phases.py"
spec = importlib.util.spec_from_file_location("profile_phases", SCRIPT)
profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile)

REPORT = """\
# Samples: 2K of event 'cpu-clock:pppH' (time slices: 65134.95,65139.0)
#
# Overhead       Samples  Shared Object                                      Symbol
# ........  ............  .................................................  ..........
#
    49.86%          1269  libggml-cpu.so.0                                   [.] ggml_vec_dot_q8_0_q8_0
     4.01%           102  [kernel.kallsyms]                                  [k] clear_page_erms
     0.24%             6  libllama.so                                        [.] set_input_kq_mask_impl<float, true, false, false, false>
     0.08%             2  libllama.so                                        [.] 0x000000000033717c
"""


def test_parse_report_keeps_samples_library_and_function():
    rows = profile.parse_report(REPORT)
    assert [r["samples"] for r in rows] == [1269, 102, 6, 2]
    assert [r["dso"] for r in rows] == ["libggml-cpu.so.0", "[kernel.kallsyms]", "libllama.so", "libllama.so"]
    assert rows[2]["sym"] == "set_input_kq_mask_impl<float, true, false, false, false>"
    assert rows[3]["sym"] == "0x000000000033717c"


def _perf_can_record(tmp_path: Path) -> bool:
    if shutil.which("perf") is None:
        return False
    probe = subprocess.run(["perf", "record", "-q", "-o", str(tmp_path / "probe.data"), "true"], capture_output=True)
    return probe.returncode == 0


def test_windows_split_a_real_recording(tmp_path):
    """Two phases of a child (sleeping, then spinning in Python) land in their own windows."""
    if not _perf_can_record(tmp_path):
        pytest.skip("perf cannot record here")
    child = ("import time, json\n"
             "c = time.CLOCK_MONOTONIC\n"
             "a = time.clock_gettime(c); time.sleep(0.6); b = time.clock_gettime(c)\n"
             "x = 0\n"
             "while time.clock_gettime(c) < b + 0.6: x += 1\n"
             "print(json.dumps([a, b, time.clock_gettime(c)]))\n")
    data = tmp_path / "perf.data"
    proc = subprocess.run([*profile.record_argv(data, 999), sys.executable, "-c", child], capture_output=True,
                          text=True, check=True)
    a, b, c = json.loads(proc.stdout.strip().splitlines()[-1])
    sleeping = profile.phase_shares(data, [a, b], top=4)
    spinning = profile.phase_shares(data, [b, c], top=4)
    assert spinning["samples"] > 200                    # ~600 samples of a busy loop at 999 Hz
    assert sleeping["samples"] < spinning["samples"] / 5  # a sleeping process is hardly sampled
    assert any("python" in lib for lib in spinning["by_library"])
    assert sum(spinning["by_library"].values()) == pytest.approx(1.0, abs=1e-3)
