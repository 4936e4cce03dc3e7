"""The README's main job, through the real console entry point."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import BUNDLED


def test_main_job_on_bundled_fixture(tmp_path):
    dst = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "kconvert.cli", "int4-to-nvfp4", str(BUNDLED), str(dst), "--quiet"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((dst / "kconvert-manifest.json").read_text())
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert manifest["summary"]["quantized_modules"] == 2 * 16 * 3
    assert not (dst / ".kconvert").exists()
