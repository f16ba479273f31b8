"""Preset lookup, inheritance and validation."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from genlib.errors import PresetError
from genlib.settings.config import resolve_settings
from genlib.settings.presets import (
    available_names,
    builtin_dir,
    list_presets,
    load_preset,
    resolve_alone,
)

BUILTINS = {"greedy", "creative", "precise", "topk", "beam"}


@pytest.fixture
def user_presets(tmp_path, monkeypatch):
    monkeypatch.setenv("GENLAB_PRESETS_DIR", str(tmp_path))
    return tmp_path


def test_builtins_exist_and_resolve(user_presets):
    assert BUILTINS <= set(available_names())
    strategies = {p.name: resolve_settings(None, p.settings).strategy
                  for _, p in list_presets()}
    assert strategies["greedy"] == "greedy" and strategies["beam"] == "beam"
    assert strategies["creative"] == strategies["precise"] == strategies["topk"] == "sample"
    assert resolve_settings(None, load_preset("creative").settings).top_p < 1.0
    assert all(p.description for _, p in list_presets())


def test_user_preset_in_folder_extends_builtin(user_presets):
    (user_presets / "mine.yaml").write_text(
        "name: mine\ndescription: warmer creative\nextends: creative\ntemperature: 1.2\n"
        "model: ../shared/models/stories260K\n")
    preset = load_preset("mine")
    assert preset.settings["temperature"] == 1.2  # child wins
    assert preset.settings["top_p"] == 0.92  # inherited
    assert preset.model == "../shared/models/stories260K"
    assert "mine" in available_names()


def test_user_preset_shadows_builtin(user_presets):
    (user_presets / "greedy.yaml").write_text("max_new_tokens: 7\n")
    assert load_preset("greedy").settings == {"max_new_tokens": 7}


def test_preset_by_path_and_relative_extends(tmp_path, user_presets):
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / "base.yaml").write_text("top_k: 11\n")
    (folder / "child.yaml").write_text("extends: base.yaml\ntemperature: 0.5\n")
    preset = load_preset(str(folder / "child.yaml"))
    assert preset.settings == {"top_k": 11, "temperature": 0.5}


def test_unknown_key_in_file_names_file_key_and_closest(tmp_path, user_presets):
    bad = tmp_path / "bad.yaml"
    bad.write_text("temprature: 0.7\n")
    with pytest.raises(PresetError) as exc:
        load_preset(str(bad))
    assert str(bad) in str(exc.value) and "'temprature'" in str(exc.value)
    assert "did you mean 'temperature'" in str(exc.value)


def test_out_of_range_value_gives_range(tmp_path, user_presets):
    bad = tmp_path / "bad.yaml"
    bad.write_text("top_p: 3\n")
    with pytest.raises(PresetError, match="0 < top_p <= 1, got 3"):
        load_preset(str(bad))


def test_yaml_is_loaded_safely(tmp_path, user_presets):
    evil = tmp_path / "evil.yaml"
    evil.write_text("temperature: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(PresetError, match="not valid YAML"):
        load_preset(str(evil))


def test_cycles_missing_and_typos(tmp_path, user_presets):
    (user_presets / "a.yaml").write_text("extends: b\n")
    (user_presets / "b.yaml").write_text("extends: a\n")
    with pytest.raises(PresetError, match="extends itself"):
        load_preset("a")
    with pytest.raises(PresetError, match="did you mean 'creative'"):
        load_preset("creativ")
    with pytest.raises(PresetError, match="does not exist"):
        load_preset(str(tmp_path / "nope.yaml"))
    (user_presets / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(PresetError, match="must be a YAML mapping"):
        load_preset("list")


def test_builtin_dir_holds_yaml_only():
    assert {p.suffix for p in builtin_dir().iterdir()} == {".yaml"}


def test_user_preset_can_extend_the_builtin_of_the_same_name(user_presets):
    (user_presets / "creative.yaml").write_text("extends: creative\ntemperature: 1.1\n")
    preset = load_preset("creative")
    assert preset.settings["temperature"] == 1.1 and preset.settings["top_p"] == 0.92


def test_relative_extends_is_read_next_to_the_preset(tmp_path, user_presets, monkeypatch):
    (user_presets / "base.yaml").write_text("top_k: 7\n")
    (user_presets / "child.yaml").write_text("extends: base.yaml\n")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (elsewhere / "base.yaml").write_text("top_k: 99\n")
    monkeypatch.chdir(elsewhere)
    assert load_preset("child").settings == {"top_k": 7}


def test_one_broken_preset_does_not_hide_the_others(user_presets):
    (user_presets / "broken.yaml").write_text("temprature: 1\n")
    listed = dict(list_presets())
    assert isinstance(listed["broken"], PresetError)
    assert listed["creative"].settings["top_p"] == 0.92


def test_a_merge_key_still_merges_while_repeated_keys_are_refused(tmp_path):
    """`<<:` is YAML's merge, not a repeated key: the duplicate check passes over it."""
    merged = tmp_path / "m.yaml"
    merged.write_text("<<: {temperature: 0.5}\ntop_p: 0.9\n")
    assert load_preset(str(merged)).settings == {"temperature": 0.5, "top_p": 0.9}
    twice = tmp_path / "t.yaml"
    twice.write_text("top_p: 0.9\ntop_p: 0.8\n")
    with pytest.raises(PresetError, match="the key 'top_p' appears twice"):
        load_preset(str(twice))


def test_numbers_in_a_preset_are_read_as_yaml_1_2_writes_them(tmp_path):
    """PyYAML's YAML 1.1 read `top_k: 010` as 8 and `seed: 1:30` as 90 (base 60)."""
    preset = tmp_path / "numbers.yaml"
    preset.write_text("top_k: 010\nseed: 0x1f\nstop_strings: [12:30]\n")
    assert load_preset(str(preset)).settings == {"top_k": 10, "seed": 31,
                                                 "stop_strings": ("12:30",)}
    preset.write_text("seed: 1:30\n")
    with pytest.raises(PresetError, match="seed must be an integer, got '1:30'"):
        load_preset(str(preset))


def test_a_missing_parent_names_the_preset_that_extends_it(user_presets):
    """The error names the file whose `extends` cannot be found, and a relative path
    where it was looked for (its folder), not only the parent's name."""
    (user_presets / "child.yaml").write_text("extends: nosuch\n")
    with pytest.raises(PresetError) as exc:
        load_preset("child")
    assert str(exc.value).startswith(f"{user_presets.resolve() / 'child.yaml'}: extends "
                                     f"'nosuch', which cannot be found: no preset named")
    (user_presets / "rel.yaml").write_text("extends: ./base.yaml\n")
    with pytest.raises(PresetError, match=f"rel.yaml: extends './base.yaml', which cannot be "
                                          f"found: preset file {user_presets.resolve()}"
                                          f"/base.yaml does not exist"):
        load_preset("rel")


def test_settings_that_do_not_combine_name_the_preset_and_hide_no_other(user_presets):
    """Each key is valid alone, the combination is not: `presets show` (resolve_alone)
    names the file, and `presets list` shows it as that one row's error."""
    bad = user_presets / "three.yaml"
    bad.write_text("num_return_sequences: 3\n")
    with pytest.raises(PresetError) as exc:
        resolve_alone(load_preset("three"))
    assert str(exc.value) == (f"{bad.resolve()}: num_return_sequences > 1 gives identical "
                              f"greedy outputs; use strategy sample or beam")
    listed = dict(list_presets())
    assert str(listed["three"]) == str(exc.value)
    assert listed["creative"].settings["top_p"] == 0.92


def test_presets_list_shows_the_name_a_preset_is_found_by(user_presets):
    """A file's `name:` may differ from its file name; `--preset` finds it by the file
    name, so the listing shows that (and `presets show NAME` then works)."""
    (user_presets / "mine.yaml").write_text("name: Something Else\ntop_k: 5\n")
    runner = CliRunner()
    listed = runner.invoke(app, ["presets", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    names = [row["name"] for row in json.loads(listed.stdout)["presets"]]
    assert "mine" in names and "Something Else" not in names
    table = runner.invoke(app, ["presets", "list"], env={"COLUMNS": "200"})
    assert " mine " in table.stdout and "Something Else" not in table.stdout
    assert runner.invoke(app, ["presets", "show", "mine"]).exit_code == 0


def test_presets_list_and_show_report_a_preset_whose_settings_do_not_combine(user_presets):
    (user_presets / "order.yaml").write_text("samplers: [top_k]\ntemperature: 0.5\n")
    runner = CliRunner()
    listed = runner.invoke(app, ["presets", "list"], env={"COLUMNS": "200"})
    assert listed.exit_code == 0, listed.output
    assert "creative" in listed.stdout and "samplers leaves out temperature" in listed.stdout
    shown = runner.invoke(app, ["presets", "show", "order"])
    assert shown.exit_code == 2
    assert shown.stderr.strip() == (
        f"error: {(user_presets / 'order.yaml').resolve()}: samplers leaves out temperature, "
        f"which the settings turn on: add them to samplers or turn them off")


def test_set_by_follows_extends_to_the_builtin_of_the_same_name(user_presets):
    """A user `creative.yaml` that extends the built-in `creative`: the built-in's keys
    are reported as set by the built-in's file (`presets show --json`'s set_by,
    --show-settings), not as genlab's defaults (top_p 0.92 is no default)."""
    mine = user_presets / "creative.yaml"
    mine.write_text("extends: creative\ntemperature: 1.1\n")
    builtin = builtin_dir().resolve() / "creative.yaml"
    assert load_preset("creative").set_by == {
        "strategy": builtin, "top_p": builtin, "max_new_tokens": builtin,
        "temperature": mine.resolve()}


def test_a_preset_without_a_description_says_whose_it_shows(user_presets):
    (user_presets / "story.yaml").write_text("extends: creative\ntemperature: 1.1\n")
    (user_presets / "bare.yaml").write_text(f"extends: {user_presets / 'plain.yaml'}\n")
    (user_presets / "plain.yaml").write_text("temperature: 0.5\ndo_sample: true\n")
    assert load_preset("story").description == \
        f"(extends creative) {load_preset('creative').description}"
    assert load_preset("bare").description == f"(extends {user_presets / 'plain.yaml'})"
    assert load_preset("plain").description == ""


def test_show_prints_a_control_character_as_a_quoted_escape(user_presets):
    """DRY's newline sequence breaker was a block of blank lines (`- '` then an empty
    line); it reads "\\n", and the YAML still loads back to the same settings."""
    import yaml

    (user_presets / "tabbed.yaml").write_text(
        'extends: creative\nstop_strings: ["a\\tb", "plain"]\n')
    result = CliRunner().invoke(app, ["presets", "show", "tabbed"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    breakers = lines.index("dry_sequence_breakers:")
    assert lines[breakers + 1] == '- "\\n"'
    assert '- "a\\tb"' in lines and "- plain" in lines
    shown = yaml.safe_load(result.stdout)
    settings = resolve_alone(load_preset("tabbed")).to_dict()
    assert shown["dry_sequence_breakers"] == list(settings["dry_sequence_breakers"])
    assert shown["stop_strings"] == ["a\tb", "plain"]


def test_preset_names_complete_built_in_and_user_presets(user_presets):
    from cli.options import complete_preset

    (user_presets / "crisp.yaml").write_text("temperature: 0.3\n")
    assert complete_preset("cr") == ["creative", "crisp"]
    assert complete_preset("") == available_names()
    assert complete_preset("greedy,pr") == ["greedy,precise"]  # compare's comma list
    assert complete_preset("nothing-like-it") == []


@pytest.mark.parametrize(("words", "expected"), [
    ("genlab generate x -p cr", ["creative", "crisp"]),
    ("genlab compare x --preset greedy,cri", ["greedy,crisp"]),
    ("genlab presets show cr", ["creative", "crisp"]),
])
def test_the_shell_completion_protocol_offers_preset_names(user_presets, words, expected):
    """What bash's completion script asks (`_GENLAB_COMPLETE=complete_bash` with
    COMP_WORDS and COMP_CWORD) gets the preset names back, one a line."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    (user_presets / "crisp.yaml").write_text("temperature: 0.3\n")
    env = {**os.environ, "_GENLAB_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split()) - 1)}
    done = subprocess.run(  # as the genlab script runs (argv[0] names the program)
        [sys.executable, "-c", "import sys; sys.argv[0] = 'genlab'; "
                               "from cli.main import run; run()"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == expected


@pytest.mark.parametrize("kind", ["folder", "dangling"])
def test_a_preset_name_that_is_no_file_says_what_it_is(user_presets, kind):
    """It said "no preset named 'dir' (did you mean 'dir'?)"."""
    entry = user_presets / "odd.yaml"
    if kind == "folder":
        entry.mkdir()
        said = f"preset 'odd' is {entry}, a folder, not a preset file; rename or remove it"
    else:
        entry.symlink_to(user_presets / "gone.yaml")
        said = (f"preset 'odd' is {entry}, a symbolic link that leads nowhere; point it at a "
                f"preset file or remove it")
    result = CliRunner().invoke(app, ["presets", "show", "odd"])
    assert (result.exit_code, result.stderr.strip()) == (2, f"error: {said}")


def test_a_nul_byte_in_a_preset_is_one_line(tmp_path):
    preset = tmp_path / "nul.yaml"
    preset.write_bytes(b"temperature: 0.5\x00\n")
    result = CliRunner().invoke(app, ["presets", "show", str(preset)])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "not valid YAML (unacceptable character #x0000" in result.stderr
