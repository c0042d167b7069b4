"""A GGUF chat template is untrusted code: it must render in the sandbox, never reach Python internals.

Each payload is a known escape from a plain jinja2 environment (attribute walks to ``__globals__``,
``__subclasses__``, ``os.popen``, mutation of the objects passed in). In the sandbox each must end
in one ``PaskError`` line and leave no file behind; end to end, ``pask-local run`` on a GGUF that
carries such a template exits non-zero with one line on stderr and creates nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pask_local.calibration.synthetic import write_synthetic_gguf

from pask_local.errors import PaskError
from pask_local.tagging.template import render_template

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "examples" / "get_weather.json"


def payloads(marker: Path) -> dict[str, str]:
    m = str(marker)
    return {
        "cycler-globals-os-system": "{{ cycler.__init__.__globals__.os.system('touch " + m + "') }}",
        "joiner-globals-popen": "{{ joiner.__init__.__globals__.os.popen('touch " + m + "').read() }}",
        "subclasses-walk": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "self-builtins-open": "{{ self.__init__.__globals__.__builtins__.open('" + m + "', 'w').write('x') }}",
        "lipsum-globals": "{{ lipsum.__globals__['os'].system('touch " + m + "') }}",
        "namespace-globals-print": "{{ namespace.__init__.__globals__ }}",
        "mutate-messages": "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages }}",
        "format-string-walk": "{{ '{0.__class__.__mro__}'.format('') }}",
    }


@pytest.mark.parametrize("name", sorted(payloads(Path("/nonexistent"))))
def test_payload_is_refused_without_side_effect(name, tmp_path):
    marker = tmp_path / "pwned"
    template = payloads(marker)[name]
    with pytest.raises(PaskError) as info:
        render_template(template, messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    msg = str(info.value)
    assert "\n" not in msg and msg
    assert not marker.exists()


def test_hf_helpers_work_in_the_sandbox():
    tpl = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
           "{{ m.content }}|{{ tools | tojson }}|{{ strftime_now('%Y') | length }}{% endfor %}")
    out = render_template(tpl, messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "ü<"}],
                          tools=[{"name": "f<x>"}])
    assert out == 'ü<|[{"name": "f<x>"}]|4'
    with pytest.raises(PaskError, match="chat template error: no tools"):
        render_template("{{ raise_exception('no tools') }}")
    with pytest.raises(PaskError, match="cannot parse"):
        render_template("{% for %}")


def _pask_local() -> list[str]:
    exe = Path(sys.executable).with_name("pask-local")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pask_local"]


def test_cli_run_on_a_gguf_with_a_hostile_template(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.gguf"
    template = payloads(marker)["cycler-globals-os-system"] + "{% for m in messages %}{{ m.content }}{% endfor %}"
    write_synthetic_gguf(evil, "qwen3", n_layer=2, n_vocab=320, chat_template=template)
    env = {**os.environ, "PASK_THREADS": "1"}
    proc = subprocess.run([*_pask_local(), "run", "--gguf", str(evil), "--schema", str(SCHEMA),
                           "--method", "full", "hi"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "unsafe" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not marker.exists()
