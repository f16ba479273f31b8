"""A normal (non-editable) install finds the built-in presets and the built-in models."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_non_editable_install_finds_builtin_presets(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                    "--quiet", "--target", str(target), str(ROOT)], check=True, timeout=300)
    assert (target / "genlab_presets" / "creative.yaml").is_file()
    for name in ("code-small", "code-tiny"):  # the built-in models ship in the wheel
        assert (target / "genlib" / "assets" / name / "model.safetensors").is_file()
        assert (target / "genlib" / "assets" / name / "tokenizer.json").is_file()
    code = ("from genlib.settings.presets import available_names, builtin_dir\n"
            "from genlib.models.loading import DEFAULT_MODEL\n"
            "print(builtin_dir()); print(','.join(available_names())); print(DEFAULT_MODEL)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(target),
                                             "GENLAB_PRESETS_DIR": str(tmp_path / "none")},
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    folder, names, default_model = proc.stdout.splitlines()
    assert folder.startswith(str(target))
    assert {"greedy", "creative", "precise", "topk", "beam"} <= set(names.split(","))
    assert default_model.startswith(str(target))
