"""Files kconvert and its fixture scripts write get the mode a new file gets under the
process umask (readable by the group and others under the usual 022), never safetensors'
private 0600: a fixture or output made by one user is readable by the loader's."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from conftest import ROOT


def test_the_fixture_script_writes_shards_under_the_umask(tmp_path):
    out = tmp_path / "fx"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_fixture.py"), str(out),
                    "--variant", "k2-int4-kimi"], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)},
                   preexec_fn=lambda: os.umask(0o022))  # 0600 and the umask's mode differ
    expected = 0o644
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert all(mode == expected for mode in modes.values()), (oct(expected), modes)
