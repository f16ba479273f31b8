"""Model loading: every failure a user can cause is one clear ModelLoadError."""

from __future__ import annotations

import shutil

import pytest

from genlib import generate
from genlib.errors import ModelLoadError
from genlib.models.loading import ModelSpec, eos_ids_of, load_model, resolve_model_ref
from genlib.settings.config import resolve_settings
from tests.conftest import CODE_DRAFT, STORIES


def test_eos_ids_come_from_generation_config_list(stories):
    assert stories.eos_ids == (1, 2)
    assert eos_ids_of(stories.model, stories.tokenizer) == (1, 2)
    assert stories.max_positions == 512
    assert stories.tokenizer.pad_token_id is None  # and batching still works (test_decode)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(ModelSpec(str(tmp_path / "nope")))


def test_a_missing_relative_folder_is_named_as_given_not_looked_up_on_the_hub(
        monkeypatch, tmp_path):
    """`./nope` is a path, existing or not: never a hub id (offline, half a minute of
    huggingface_hub's retries and then "not in the cache")."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSpec("./nope"))
    assert str(info.value) == ("model folder ./nope does not exist; give a local folder in "
                               "Hugging Face layout or a hub id like 'org/name'")


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


def test_hub_model_cached_without_its_tokenizer_files(monkeypatch, tmp_path):
    """A snapshot in the cache with config.json alone (a download cut short): one line
    naming the missing tokenizer files and the fix, not the first line of transformers'
    five-line message."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--genlab-tests--partial"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    shutil.copy(STORIES / "config.json", repo / "snapshots" / "abc123" / "config.json")
    with pytest.raises(ModelLoadError) as caught:
        load_model(ModelSpec("genlab-tests/partial"))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("cannot load the tokenizer of genlab-tests/partial: its files "
                              "have no tokenizer.json")
    assert message.endswith("download the model again in full, or give a local folder")


def test_unavailable_device_and_bad_names():
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA GPU"):
            load_model(ModelSpec(str(STORIES), device="cuda"))
    with pytest.raises(ModelLoadError, match="--dtype must be one of auto, float32, "
                                             "bfloat16, float16, got 'float8'"):
        load_model(ModelSpec(str(STORIES), dtype="float8"))
    with pytest.raises(ModelLoadError,
                       match="--quantize must be one of none, 8bit, 4bit, q8_0, nf4, q4_0, "
                             "got '3bit'"):
        load_model(ModelSpec(str(STORIES), quantize="3bit"))


def test_bitsandbytes_4bit_on_cpu_refuses_widths_not_divisible_by_32():
    """bitsandbytes quantizes on a CPU where --backend transformers asks for it; the
    native kernel, auto's choice, takes any width."""
    with pytest.raises(ModelLoadError, match="divisible by 32.*gate_proj \\(64x172\\)"):
        load_model(ModelSpec(str(STORIES), quantize="4bit", backend="transformers"))
    assert load_model(ModelSpec(str(STORIES), quantize="4bit")).weights == "nf4"


def test_bfloat16_loads_and_generates():
    import torch

    lm = load_model(ModelSpec(str(STORIES), dtype="bfloat16"))
    assert lm.dtype == torch.bfloat16
    [out] = generate.generate(lm, [lm.encode("Once upon a time")],
                            resolve_settings({"max_new_tokens": 8}))
    assert out.new_tokens == 8 and out.text.startswith(",")


@pytest.mark.slow
def test_8bit_and_4bit_bitsandbytes_quantization_generate_on_cpu():
    """--backend transformers keeps bitsandbytes' layers (auto gives a CPU the native
    kernel's formats: tests/test_quantized.py)."""
    if not CODE_DRAFT.is_dir():
        pytest.skip("code-draft not present")
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    "
    for mode, layer in (("8bit", "Linear8bitLt"), ("4bit", "Linear4bit")):
        lm = load_model(ModelSpec(str(CODE_DRAFT), quantize=mode, backend="transformers"))
        assert type(lm.model.model.layers[0].mlp.gate_proj).__name__ == layer
        [out] = generate.generate(lm, [lm.encode(prompt)], resolve_settings({"max_new_tokens": 12}))
        assert out.new_tokens >= 1 and out.text.strip()


def test_model_ref_precedence(monkeypatch):
    monkeypatch.setenv("GENLAB_MODEL", "env/model")
    assert resolve_model_ref("flag/model", "preset/model") == "flag/model"
    assert resolve_model_ref(None, "preset/model") == "preset/model"
    assert resolve_model_ref(None, None) == "env/model"
    monkeypatch.delenv("GENLAB_MODEL")
    assert resolve_model_ref(None, None) == "builtin:code-small"


def test_trust_remote_code_is_off_by_default():
    assert ModelSpec("x").trust_remote_code is False


def test_builtin_models_by_name():
    from genlib.models.loading import DEFAULT_DRAFT, DEFAULT_MODEL, display_name, model_source

    assert display_name(str(DEFAULT_MODEL)) == "builtin:code-small"
    assert display_name(str(DEFAULT_DRAFT) + "/") == "builtin:code-tiny"
    assert display_name("org/name") == "org/name"
    assert model_source("builtin:code-tiny") == str(DEFAULT_DRAFT)
    assert resolve_model_ref(str(DEFAULT_MODEL)) == "builtin:code-small"
    with pytest.raises(ModelLoadError, match="builtin:code-small, builtin:code-tiny"):
        model_source("builtin:code-huge")


@pytest.mark.parametrize("quick", [True, False])
def test_a_builtin_model_loads_by_name_and_keeps_it(quick):
    lm = load_model(ModelSpec("builtin:code-tiny"), quick=quick)
    assert lm.ref == "builtin:code-tiny"
    (finish,) = generate.generate(lm, [lm.encode("def f(")],
                                  resolve_settings({"max_new_tokens": 2, "ignore_eos": True}))
    assert finish.new_tokens == 2


def test_an_unreachable_hub_fails_at_once_with_what_to_do(monkeypatch):
    """A real request to a closed local port stands for a machine without network."""
    import time

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSpec("genlab-test/not-cached-anywhere"))
    message = str(info.value)
    assert "cannot reach the Hugging Face hub" in message
    assert message.endswith("set HF_HUB_OFFLINE=1 to use the local cache, or give a local "
                            "folder in its place")  # not "with --model": a draft's is -d
    assert "\n" not in message
    assert time.perf_counter() - start < 3  # not huggingface_hub's half-minute of retries


def test_an_unreachable_hub_loads_a_cached_model_from_the_cache(monkeypatch):
    import huggingface_hub

    from genlib.models import loading as models

    monkeypatch.setattr(models, "_hub_reachable", lambda: False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda repo, name: f"/cache/{repo}/{name}")
    assert models.hub_files_only("org/cached") is True
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE=1"):
        models.hub_files_only("org/not-cached")


def test_a_models_generation_config_is_read_from_where_the_model_loaded(tmp_path,
                                                                        monkeypatch):
    """--show-settings and /show read generation_config.json beside the weights; for a
    built-in name or a `~/...` path they missed the file and loaded the whole
    transformers model to ask it instead."""
    from genlib.settings.provenance import model_generation_config

    def no_load():
        raise AssertionError("the model was loaded to read its generation config")

    home = tmp_path / "home"
    (home / "m").mkdir(parents=True)
    (home / "m" / "generation_config.json").write_text('{"temperature": 0.6, "top_k": 7}')
    monkeypatch.setenv("HOME", str(home))
    assert model_generation_config("~/m", no_load) == {"temperature": 0.6, "top_k": 7}
    assert model_generation_config("builtin:code-small", no_load) == {}
