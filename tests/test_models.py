"""Model loading: every failure a user can cause is one clear ModelLoadError."""

from __future__ import annotations

import pytest

from genlib import generate
from genlib.config import resolve_settings
from genlib.errors import ModelLoadError
from genlib.models import ModelSpec, eos_ids_of, load_model, resolve_model_ref
from tests.conftest import CODE_DRAFT, STORIES


def test_eos_ids_come_from_generation_config_list(stories):
    assert stories.eos_ids == (1, 2)
    assert eos_ids_of(stories.model, stories.tokenizer) == (1, 2)
    assert stories.max_positions == 512
    assert stories.tokenizer.pad_token_id is None  # and batching still works (test_decode)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(ModelSpec(str(tmp_path / "nope")))


def test_folder_that_is_not_a_model(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(ModelSpec(str(tmp_path)))


def test_uncached_hub_id_while_offline(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        load_model(ModelSpec("genlab-tests/surely-not-cached-model"))


def test_unavailable_device_and_bad_names():
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA GPU"):
            load_model(ModelSpec(str(STORIES), device="cuda"))
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(ModelSpec(str(STORIES), dtype="float8"))
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_model(ModelSpec(str(STORIES), quantize="3bit"))


def test_4bit_on_cpu_refuses_widths_not_divisible_by_32():
    with pytest.raises(ModelLoadError, match="divisible by 32.*gate_proj \\(64x172\\)"):
        load_model(ModelSpec(str(STORIES), quantize="4bit"))


def test_bfloat16_loads_and_generates():
    import torch

    lm = load_model(ModelSpec(str(STORIES), dtype="bfloat16"))
    assert lm.dtype == torch.bfloat16
    [out] = generate.generate(lm, [lm.encode("Once upon a time")],
                            resolve_settings({"max_new_tokens": 8}))
    assert out.new_tokens == 8 and out.text.startswith(",")


@pytest.mark.slow
def test_8bit_and_4bit_quantization_generate_on_cpu():
    if not CODE_DRAFT.is_dir():
        pytest.skip("code-draft not present")
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    "
    for mode, layer in (("8bit", "Linear8bitLt"), ("4bit", "Linear4bit")):
        lm = load_model(ModelSpec(str(CODE_DRAFT), quantize=mode))
        assert type(lm.model.model.layers[0].mlp.gate_proj).__name__ == layer
        [out] = generate.generate(lm, [lm.encode(prompt)], resolve_settings({"max_new_tokens": 12}))
        assert out.new_tokens >= 1 and out.text.strip()


def test_model_ref_precedence(monkeypatch):
    monkeypatch.setenv("GENLAB_MODEL", "env/model")
    assert resolve_model_ref("flag/model", "preset/model") == "flag/model"
    assert resolve_model_ref(None, "preset/model") == "preset/model"
    assert resolve_model_ref(None, None) == "env/model"
    monkeypatch.delenv("GENLAB_MODEL")
    assert resolve_model_ref(None, None).endswith("code-small")


def test_trust_remote_code_is_off_by_default():
    assert ModelSpec("x").trust_remote_code is False
