"""Broken local model folders: one clear line that names the file at fault (and the
tensor or field), says how to fix it, and exits 2, on both load paths (`generate`'s quick
start, which hands such folders to transformers' load, and `beam`'s transformers load);
never the "unexpected" wording of a bug. A config.json that does not describe the
weights is refused before transformers builds the model it describes (which for a bare
`{"model_type": "llama"}` is a 7B model: tens of GB)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from genlib.errors import ModelLoadError
from genlib.models.loading import ModelSpec, load_model
from tests.conftest import CODE_TARGET, STORIES

runner = CliRunner()
COMMANDS = {"generate": ["generate", "Once", "-n", "2"],  # the quick start first
            "beam": ["beam", "Once", "-n", "2", "-k", "2"]}  # transformers' load only


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def no_model_build(monkeypatch):
    """transformers' from_pretrained fails the test: a folder whose config.json does not
    match its weights must be refused before the model is built (an OOM otherwise)."""
    from transformers import AutoModelForCausalLM

    def build(*args, **kwargs):
        pytest.fail("transformers built the model before the weights were compared")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", build)


def copy_of_stories(root: Path) -> Path:
    """stories260K as links to the shared files; a file to change is replaced, not edited."""
    folder = root / "model"
    folder.mkdir()
    for item in STORIES.iterdir():
        (folder / item.name).symlink_to(item)
    return folder


def write(folder: Path, name: str, text: str) -> None:
    (folder / name).unlink(missing_ok=True)
    (folder / name).write_text(text)


def edit_config(**changes) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        config = json.loads((STORIES / "config.json").read_text())
        write(folder, "config.json", json.dumps({**config, **changes}))
    return change


def replace_config(text: str) -> Callable[[Path], None]:
    return lambda folder: write(folder, "config.json", text)


def remove(*names: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        for name in names:
            (folder / name).unlink()
    return change


def assert_refused(args: list[str], *fragments: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.output, result.exception)
    line = result.stderr.strip()
    assert line.startswith("error: cannot load ") and "\n" not in line, line
    assert "unexpected" not in line
    for fragment in fragments:
        assert fragment in line, line


MISMATCH = "config.json does not match the weights ("
FIX_MISMATCH = "; fix config.json or use the folder the weights came from"
FIX_CONFIG = "; fix config.json or restore it from the model's source"


def renamed_tensor(folder: Path) -> None:
    """One matrix under another name: the weights lack it and hold a stranger."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(STORIES / "model.safetensors"))
    tensors["bogus.model.layers.2.mlp.down_proj.weight"] = \
        tensors.pop("model.layers.2.mlp.down_proj.weight")
    (folder / "model.safetensors").unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("change", "fragments"), [
    (renamed_tensor, [MISMATCH + "they lack model.layers.2.mlp.down_proj.weight, which "
                      "config.json's model needs, and hold bogus.model.layers.2.mlp."
                      "down_proj.weight, which it has no place for)" + FIX_MISMATCH]),
    (edit_config(model_type="gpt2"), [MISMATCH + "they lack lm_head.weight and ",
                                      "more, which config.json's model needs, and hold "
                                      "model.embed_tokens.weight"]),
], ids=["renamed", "another-architecture"])
def test_weights_transformers_would_fill_with_random_values_are_refused(
        tmp_path, command, change, fragments):
    """Both loaded with exit 0 and wrote nonsense: transformers filled what the weights
    lack with random values, and the model ran on them."""
    folder = copy_of_stories(tmp_path)
    change(folder)
    assert_refused([*COMMANDS[command], "-m", str(folder)], *fragments)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("change", "fragments"), [
    (replace_config('{"model_type": "llama"}'),
     [MISMATCH + "model.embed_tokens.weight is (512, 64) in the weights, (32000, 4096) by "
      "config.json)" + FIX_MISMATCH]),
    (edit_config(vocab_size=1000),
     [MISMATCH + "model.embed_tokens.weight is (512, 64) in the weights, (1000, 64) by "
      "config.json)" + FIX_MISMATCH]),
    (edit_config(hidden_size=128),
     [MISMATCH + "model.embed_tokens.weight is (512, 64) in the weights, (512, 128) by "
      "config.json)"]),
    (edit_config(num_hidden_layers=3),
     [MISMATCH + "the weights hold model.layers.3.input_layernorm.weight, which "
      "config.json's model has no place for)"]),
    (edit_config(num_hidden_layers=7),
     [MISMATCH + "the weights lack model.layers.5.", "which config.json's model needs)"]),
    (edit_config(tie_word_embeddings=False),
     [MISMATCH + "the weights lack lm_head.weight, which config.json's model needs)"]),
], ids=["bare-llama", "vocab", "hidden", "fewer-layers", "more-layers", "untied"])
def test_a_config_that_does_not_match_the_weights_is_refused_before_building(
        tmp_path, no_model_build, command, change, fragments):
    folder = copy_of_stories(tmp_path)
    change(folder)
    assert_refused([*COMMANDS[command], "-m", str(folder)], *fragments)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("change", "fragments"), [
    (edit_config(num_hidden_layers="five"),
     ["config.json is invalid (Field 'num_hidden_layers' expected int, got str (value: "
      "'five'))" + FIX_CONFIG]),
    (edit_config(num_attention_heads=3),
     ["config.json is invalid (The hidden size (64) is not a multiple of the number of "
      "attention heads (3))" + FIX_CONFIG]),
    (replace_config("null"), ["config.json holds null, not a JSON object" + FIX_CONFIG]),
    (replace_config('{"model_type": "llama",\n'),
     ["config.json is not valid JSON (Expecting property name enclosed in double quotes "
      "at line 2 column 1)" + FIX_CONFIG]),
    (replace_config('{"model_type": "lla\tma"}'),  # json's own message ends in "at"
     ["config.json is not valid JSON (Invalid control character at line 1 column 20)"
      + FIX_CONFIG]),
    (edit_config(max_position_embeddings=0),
     ["config.json sets max_position_embeddings to 0, which must be at least 1"
      + FIX_CONFIG]),
    (edit_config(num_attention_heads=0),  # transformers' own check divided by it
     ["config.json is invalid (it sets num_attention_heads to 0, which must be at least 1)"
      + FIX_CONFIG]),
    (edit_config(num_key_value_heads=0),  # the model's build divided by it
     ["config.json sets num_key_value_heads to 0, which must be at least 1" + FIX_CONFIG]),
    (edit_config(hidden_act="nope"),  # transformers' KeyError said only 'nope'
     ["config.json sets hidden_act to 'nope', which transformers ", " does not know"
      + FIX_CONFIG]),
    (edit_config(rope_parameters={"rope_type": "nope", "rope_theta": 10000.0}),
     ["config.json sets rope_parameters.rope_type to 'nope', which transformers "]),
    (edit_config(rms_norm_eps=float("nan")),  # ran, and wrote nothing (NaN logits)
     ["config.json sets rms_norm_eps to nan, which must be a finite number above 0"
      + FIX_CONFIG]),
    (edit_config(rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
     ["config.json sets rope_theta to -1.0, which must be a finite number above 0"]),
], ids=["field-type", "heads", "null", "not-json", "control-character", "no-positions",
        "no-heads", "no-kv-heads", "activation", "rope-type", "nan-eps", "negative-theta"])
def test_bad_config_values_are_load_errors_naming_the_field(tmp_path, command, change,
                                                            fragments):
    folder = copy_of_stories(tmp_path)
    change(folder)
    assert_refused([*COMMANDS[command], "-m", str(folder)], *fragments)


NO_TOKENIZER = ("the folder has no tokenizer file (tokenizer.json or tokenizer.model); copy "
                "the model's tokenizer files into it from the model's source")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("change", "fragments"), [
    (remove("tokenizer.json", "tokenizer_config.json"), [NO_TOKENIZER]),
    (remove("tokenizer.json"), [NO_TOKENIZER]),  # transformers builds an empty tokenizer
    (lambda folder: write(folder, "tokenizer.json", '{"version": "1.0",\n'),
     ["tokenizer.json is not valid JSON (Expecting property name enclosed in double quotes "
      "at line 2 column 1); restore it from the model's source"]),
    (lambda folder: write(folder, "tokenizer_config.json", "{\n"),
     ["tokenizer_config.json is not valid JSON (", "; restore it from the model's source"]),
    (lambda folder: write(folder, "tokenizer_config.json", "null"),
     ["tokenizer_config.json holds null, not a JSON object; restore it"]),
    (lambda folder: write(folder, "tokenizer.json", "{}"),
     ["cannot load the tokenizer of ", "restore its tokenizer files (tokenizer.json, "
      "tokenizer_config.json) from the model's source"]),
], ids=["no-tokenizer-files", "no-tokenizer-json", "tokenizer-json", "tokenizer-config",
        "tokenizer-config-null", "tokenizer-json-empty"])
def test_broken_tokenizer_files_are_named_with_the_fix(tmp_path, command, change, fragments):
    folder = copy_of_stories(tmp_path)
    change(folder)
    assert_refused([*COMMANDS[command], "-m", str(folder)], *fragments)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_file_given_as_the_model_folder_names_the_folder(tmp_path, command):
    folder = copy_of_stories(tmp_path)
    result = runner.invoke(app, [*COMMANDS[command], "-m", str(folder / "config.json")])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"error: {folder / 'config.json'} is a file, not a model folder; point --model at "
        f"the folder holding config.json and the weights: --model {folder}")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("target", ["loop", "missing"])
def test_a_symlink_that_leads_nowhere_is_named_as_one(tmp_path, command, target):
    link = tmp_path / "model"
    link.symlink_to(tmp_path / ("model" if target == "loop" else "gone"))
    result = runner.invoke(app, [*COMMANDS[command], "-m", str(link)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"error: model folder {link} is a symbolic link that leads nowhere (its target is "
        f"missing, or links lead back to it); point --model at the model folder itself")


class Payload:
    """A pickle that would run code when loaded: it would create the file `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("weights", ["code", "garbage"])
def test_bin_weights_that_are_not_plain_tensors_are_refused_unrun(tmp_path, command, weights):
    """pytorch_model.bin is a pickle: transformers reads it with torch's weights_only, so
    a pickle holding code is refused without running it, in one line (not torch's own
    advice to load it with weights_only=False), as is one that is not a pickle at all."""
    import torch

    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        (folder / name).symlink_to(STORIES / name)
    marker = tmp_path / "ran"
    if weights == "code":
        torch.save({"model.embed_tokens.weight": Payload(marker)},
                   folder / "pytorch_model.bin")
    else:
        (folder / "pytorch_model.bin").write_bytes(bytes(range(256)) * 4)
    result = runner.invoke(app, [*COMMANDS[command], "-m", str(folder)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"error: the .bin weights of {folder} are not plain tensors: the pickle holds other "
        f"Python objects (which genlab never runs) or is damaged; use the model's "
        f"safetensors weights, or download it again from a source you trust")
    assert not marker.exists()


@pytest.mark.parametrize("quick", [True, False])
def test_a_sharded_checkpoint_is_compared_shard_by_shard(tmp_path, quick):
    """model.safetensors.index.json's shards: a matching config loads, a config whose
    vocabulary differs is refused naming the embedding, a broken index is named."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(STORIES).save_pretrained(folder,
                                                                  max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(STORIES / name)
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    assert load_model(ModelSpec(str(folder)), quick=quick).encode("Once") == [1, 403]
    edit_config(vocab_size=1000)(folder)
    with pytest.raises(ModelLoadError, match=r"model.embed_tokens.weight is \(512, 64\) in "
                                             r"the weights, \(1000, 64\) by config.json"):
        load_model(ModelSpec(str(folder)), quick=quick)
    write(folder, "model.safetensors.index.json", '{"weight_map": \n')
    with pytest.raises(ModelLoadError, match=r"model.safetensors.index.json is not valid JSON "
                                             r"\(Expecting value at line 2 column 1\); "
                                             r"restore it from the model's source$"):
        load_model(ModelSpec(str(folder)), quick=quick)


def test_a_base_model_checkpoint_without_the_prefix_still_loads(tmp_path):
    """Weights saved from the base model (`layers.0...`, no `model.`) load as transformers
    loads them; their shapes are still compared."""
    from safetensors.torch import load_file, save_file

    folder = copy_of_stories(tmp_path)
    tensors = load_file(STORIES / "model.safetensors")
    (folder / "model.safetensors").unlink()
    save_file({name.removeprefix("model."): t for name, t in tensors.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    assert load_model(ModelSpec(str(folder))).encode("Once") == [1, 403]
    edit_config(hidden_size=128)(folder)
    with pytest.raises(ModelLoadError, match=r"\(512, 64\) in the weights, \(512, 128\)"):
        load_model(ModelSpec(str(folder)))


@pytest.mark.parametrize(("text", "fragment"), [
    ("{broken", "generation_config.json is not valid JSON (Expecting property name"),
    ("null", "generation_config.json holds null, not a JSON object"),
    ("[1, 2]", "generation_config.json holds [1, 2], not a JSON object"),
    ('{"eos_token_id": "x"}', 'generation_config.json sets eos_token_id to "x", which must '
                              'be a token id (an integer or a list of integers)'),
    ('{"eos_token_id": [1, null]}', "sets eos_token_id to [1, null], which must be a token"),
    ('{"eos_token_id": 1.5}', "sets eos_token_id to 1.5, which must be a token id"),
    ('{"pad_token_id": [1, 2]}', "generation_config.json sets pad_token_id to [1, 2], which "
                                 "must be a token id (an integer)"),
    pytest.param('{"eos_token_id": ' + "9" * 5000 + "}",  # not json's advice to raise a limit
                 "generation_config.json holds an integer of 5,000 digits, more than Python "
                 "reads", id="long-integer")])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_broken_generation_config_is_named(tmp_path, command, text, fragment):
    """transformers passes over a generation_config.json that is not JSON (the end ids
    it names are then lost) and fails with a TypeError on JSON that is not an object, or
    on an end or pad id that is not an integer."""
    folder = copy_of_stories(tmp_path)
    write(folder, "generation_config.json", text)
    result = runner.invoke(app, [*COMMANDS[command], "-m", str(folder)])
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr and "fix it, or remove it" in result.stderr
    assert "unexpected" not in result.stderr and len(result.stderr.splitlines()) == 1


def test_tensors_transformers_is_told_to_drop_are_not_a_mismatch(tmp_path, monkeypatch):
    """A checkpoint may hold tensors the model's class tells transformers to drop (its
    `_keys_to_ignore_on_load_unexpected`, e.g. Gemma's kv-shared layers): the folder
    loads, as from_pretrained loads it. Without the rule, the same tensors are refused."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    folder = copy_of_stories(tmp_path)
    tensors = load_file(STORIES / "model.safetensors")
    extra = {"model.layers.5.self_attn.k_proj.weight":
             tensors["model.layers.0.self_attn.k_proj.weight"].clone()}
    (folder / "model.safetensors").unlink()
    save_file({**tensors, **extra}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="the weights hold model.layers.5.self_attn"):
        load_model(ModelSpec(str(folder)))
    monkeypatch.setattr(LlamaForCausalLM, "_keys_to_ignore_on_load_unexpected",
                        [r"layers\.5\.self_attn\.k_proj"], raising=False)
    assert load_model(ModelSpec(str(folder))).encode("Once") == [1, 403]


def test_a_tokenizer_that_needs_a_library_says_so_not_to_restore_files(tmp_path,
                                                                       monkeypatch):
    from transformers import AutoTokenizer

    def needs_library(*args, **kwargs):
        raise ImportError("LlamaTokenizer requires the SentencePiece library: "
                          "pip install sentencepiece")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", needs_library)
    with pytest.raises(ModelLoadError) as caught:
        load_model(ModelSpec(str(copy_of_stories(tmp_path))))
    assert "pip install sentencepiece" in str(caught.value)
    assert "restore" not in str(caught.value)


@pytest.mark.parametrize("command", [*COMMANDS, "speculate"])
def test_a_tokenizer_larger_than_the_model_is_refused_before_the_forward(tmp_path, command):
    """Another model's tokenizer in the folder (8192 tokens for 512 embeddings): the
    prompt's ids are refused with both sizes, not an IndexError inside the forward."""
    folder = copy_of_stories(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
        (folder / name).symlink_to(CODE_TARGET / name)
    lookup = ["--prompt-lookup", "2"] if command == "speculate" else []
    result = runner.invoke(app, [command, "def fibonacci(n):", "-n", "2", "-m", str(folder),
                                 *lookup])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.strip() == (
        f"error: the prompt holds token id 1248, but {folder} has only 512 embeddings (ids "
        f"0-511): its tokenizer (8192 tokens) is not the model's; use the tokenizer files the "
        f"model was trained with")


@pytest.mark.parametrize("flag", ["-m", "--amateur"])
@pytest.mark.parametrize("name", ["foo bar", "bad id!", "a" * 300])
def test_a_name_that_is_neither_a_folder_nor_a_hub_id_is_refused(flag, name):
    """huggingface_hub's validation error reached the user as "unexpected", exit 1."""
    result = runner.invoke(app, ["generate", "Once", "-n", "2", flag, name])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.strip() == (
        f"error: {name!r} is neither a local folder nor a hub id (letters, digits, '-', "
        f"'_' and '.', 'org/name', at most 96 characters); give a local folder in Hugging "
        f"Face layout or a hub id like 'org/name'")


def test_a_folder_under_an_unknown_users_home_is_refused():
    result = runner.invoke(app, ["generate", "Once", "-n", "2", "-m", "~no-such-user-x/m"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.strip() == ("error: model folder ~no-such-user-x/m names a user this "
                                     "machine does not know; give the folder's full path")


def test_compare_shows_a_bad_name_in_its_column_and_runs_the_others():
    result = runner.invoke(app, ["compare", "Once", "-n", "2", "--json", "--models",
                                 f"bad id!,{STORIES}"])
    assert result.exit_code == 0, (result.output, result.exception)
    runs = json.loads(result.stdout)["runs"]
    assert "'bad id!' is neither a local folder nor a hub id" in runs[0]["error"]
    assert runs[1]["error"] is None and runs[1]["outputs"]


@pytest.mark.parametrize("locked", ["folder", "weights"])
def test_a_folder_or_file_the_user_may_not_read_is_named(tmp_path, locked):
    """An unreadable folder said "unexpected PermissionError", exit 1; an unreadable
    weights file, that it did not exist."""
    import os
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "model"
    shutil.copytree(STORIES, folder)
    (folder if locked == "folder" else folder / "model.safetensors").chmod(0)
    command = [sys.executable, "-m", "cli", "generate", "Once", "-n", "2", "-m", str(folder)]
    if os.geteuid() == 0:  # root reads anything: drop that power for the run
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv")
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *command]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).parent.parent)
    finally:
        folder.chmod(0o755)
        (folder / "model.safetensors").chmod(0o644)
    what = f"model folder {folder}" if locked == "folder" else \
        f"model.safetensors in model folder {folder}"
    assert (done.returncode, done.stderr.strip()) == (2, (
        f"error: cannot read {what} (permission denied); give yourself read access "
        f"(chmod -R u+rX {folder})"))
