"""Settings validation and THE precedence rule: flag > preset > defaults."""

from __future__ import annotations

import math
import sys

import pytest

from genlib.errors import ConfigError
from genlib.settings.config import (
    SPECS,
    GenerationSettings,
    parse_assignments,
    resolve_settings,
    validate_settings,
)


def test_defaults_are_greedy():
    s = resolve_settings()
    assert s.strategy == "greedy" and not s.do_sample and s.max_new_tokens == 128
    assert set(SPECS) == set(s.to_dict())


def test_flag_beats_preset_beats_default():
    preset = {"temperature": 0.5, "top_p": 0.9, "max_new_tokens": 40}
    s = resolve_settings({"temperature": 1.2, "top_p": None}, preset)
    assert s.temperature == 1.2  # flag
    assert s.top_p == 0.9  # preset (flag not given)
    assert s.max_new_tokens == 40  # preset
    assert s.top_k == 0  # default
    assert s.strategy == "sample"


def test_strategy_inference_and_explicit_strategy_wins():
    assert resolve_settings({"top_k": 5}).strategy == "sample"
    assert resolve_settings({"num_beams": 3}).strategy == "beam"
    assert resolve_settings({"strategy": "beam"}).num_beams == 4
    assert resolve_settings({"strategy": "beam", "num_beams": 1}).num_beams == 1
    explicit = resolve_settings({"strategy": "greedy"}, {"strategy": "sample", "top_p": 0.8})
    assert explicit.strategy == "greedy" and not explicit.do_sample
    assert explicit.unused == ("top_p",)
    assert resolve_settings({"do_sample": True, "num_beams": 2}).do_sample  # beam sampling


def test_beams_over_a_sampling_preset_sample_unless_told_not_to():
    creative = {"strategy": "sample", "temperature": 0.9, "top_p": 0.92}
    beams = resolve_settings({"strategy": "beam"}, creative)
    assert beams.strategy == "beam" and beams.do_sample and beams.unused == ()
    plain = resolve_settings({"strategy": "beam", "do_sample": False}, creative)
    assert not plain.do_sample and plain.unused == ("temperature", "top_p")
    assert resolve_settings({"strategy": "beam"}, {"temperature": 0.7}).do_sample
    # presets that do not sample, and sampling flags on the command line, stay plain beams
    assert not resolve_settings({"strategy": "beam"}, {"strategy": "beam"}).do_sample
    assert not resolve_settings({"strategy": "beam"}, {"max_new_tokens": 9}).do_sample
    assert not resolve_settings({"strategy": "beam", "temperature": 0.5}).do_sample


def test_unknown_key_names_source_key_and_closest():
    with pytest.raises(ConfigError) as exc:
        validate_settings({"temprature": 0.7}, "my.yaml")
    message = str(exc.value)
    assert "my.yaml" in message and "'temprature'" in message and "'temperature'" in message


@pytest.mark.parametrize("key,value,fragment", [
    ("temperature", 0, "temperature must be > 0"),
    ("top_p", 1.5, "0 < top_p <= 1"),
    ("top_k", -1, "top_k must be >= 0"),
    ("top_k", 2.5, "top_k must be an integer"),
    ("max_new_tokens", True, "max_new_tokens must be an integer"),
    ("temperature", "hot", "temperature must be a number"),
    ("stop_strings", [1], "stop_strings must be a string or a list"),
    ("early_stopping", "sometimes", "early_stopping must be true, false"),
    ("strategy", "gready", "did you mean 'greedy'"),
    ("min_p", 2.0, "0 <= min_p <= 1"),
])
def test_wrong_types_and_ranges_give_allowed_range(key, value, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        validate_settings({key: value}, "test")


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="num_return_sequences"):
        resolve_settings({"num_return_sequences": 2})
    with pytest.raises(ConfigError, match="divisible"):
        resolve_settings({"num_beams": 4, "num_beam_groups": 3})
    with pytest.raises(ConfigError, match="diversity_penalty needs"):
        resolve_settings({"num_beams": 4, "diversity_penalty": 0.5})
    with pytest.raises(ConfigError, match="needs strategy beam"):
        resolve_settings({"strategy": "sample", "num_beams": 3})


def test_numbers_are_read_as_yaml_1_2_writes_them():
    """PyYAML reads YAML 1.1, where 1:0 is 60, 1:30 is 90 and 010 is 8; a setting given
    so is refused as the text it is, or read in base 10, not taken as a number nobody
    wrote."""
    with pytest.raises(ConfigError, match="top_k"):
        parse_assignments("top_k=1:0", "/set")
    with pytest.raises(ConfigError, match="seed"):
        parse_assignments("seed=1:30", "/set")
    assert parse_assignments("stop_strings=12:30", "/set")["stop_strings"] == ("12:30",)
    assert parse_assignments("top_k=010 seed=0x1f", "/set") == {"top_k": 10, "seed": 31}
    assert parse_assignments("temperature=1e-1", "/set")["temperature"] == 0.1


def test_parse_assignments_types_values_like_yaml():
    parsed = parse_assignments("temperature=0.7, top_k=5 stop_strings=END", "--variant")
    assert parsed == {"temperature": 0.7, "top_k": 5, "stop_strings": ("END",)}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_assignments("temperature", "--variant")
    with pytest.raises(ConfigError, match="did you mean 'top_p'"):
        parse_assignments("top_pp=0.9", "--variant")


def test_settings_are_frozen_and_replace_revalidates():
    s = resolve_settings({"temperature": 0.7})
    with pytest.raises(AttributeError):
        s.temperature = 2.0  # type: ignore[misc]
    assert s.replace(seed=3).seed == 3 and s.replace(seed=3).temperature == 0.7
    with pytest.raises(ConfigError):
        s.replace(top_p=0)
    assert isinstance(s, GenerationSettings)


def test_settings_built_directly_are_validated_too():
    """No GenerationSettings holds a value resolve_settings would refuse: a range, a type
    or a cross-field rule broken in the constructor is the same ConfigError."""
    from genlib.errors import ConfigError
    from genlib.settings.config import GenerationSettings

    for bad, message in (({"temperature": 0}, "temperature must be > 0"),
                         ({"top_p": 1.5}, "top_p must be 0 < top_p <= 1"),
                         ({"max_new_tokens": "12"}, "max_new_tokens must be an integer"),
                         ({"num_return_sequences": 2}, "identical greedy outputs")):
        with pytest.raises(ConfigError, match=message):
            GenerationSettings(**bad)
    assert GenerationSettings(stop_strings=["a"]).stop_strings == ("a",)  # canonical form


def test_every_default_is_written_once_in_specs():
    import dataclasses

    from genlib.settings.config import SPECS, GenerationSettings, resolve_settings

    built = GenerationSettings()
    for f in dataclasses.fields(GenerationSettings):
        if f.name in SPECS and f.name not in ("strategy", "do_sample"):
            assert getattr(built, f.name) == SPECS[f.name].default, f.name
    assert resolve_settings() == built  # the empty settings resolve to the defaults


def test_a_key_given_twice_in_one_assignment_list_is_refused():
    """`top_k=5,top_k=6` kept the last value unseen, where a JSON line's repeated key is
    refused."""
    with pytest.raises(ConfigError, match=r"^--variant: top_k is given twice; give it once$"):
        parse_assignments("top_k=5,top_k=6", "--variant")
    assert parse_assignments("top_k=5,top_p=0.9", "--variant") == {"top_k": 5, "top_p": 0.9}


def test_early_stopping_never_is_read_in_any_case_as_true_and_false_are():
    """`--early-stopping True` was taken and `NEVER` refused."""
    for text, value in (("NEVER", "never"), ("Never", "never"), ("True", True),
                        ("false", False)):
        assert parse_assignments(f"early_stopping={text}", "--variant") == {
            "early_stopping": value}


def test_a_schema_text_holding_an_integer_too_long_to_read_is_named():
    """json.loads raised a ValueError advising sys.set_int_max_str_digits, which reached
    the user as `unexpected ValueError` (--json-schema FILE)."""
    schema = '{"type": "string", "maxLength": ' + "9" * 5000 + "}"
    with pytest.raises(ConfigError) as caught:
        validate_settings({"json_schema": schema}, "--json-schema")
    assert str(caught.value) == ("--json-schema: json_schema holds an integer of 5,000 digits, "
                                 "more than Python reads; no schema needs one")


@pytest.mark.parametrize("penalty, word", [(500.0, "overflow"), (-1000.0, "vanish")])
def test_a_length_penalty_whose_power_leaves_float_range_is_refused(penalty, word):
    """It crashed the search with an OverflowError or a ZeroDivisionError (as it does
    transformers' beam search), after the first tokens were printed."""
    with pytest.raises(ConfigError) as refused:
        resolve_settings({"num_beams": 2, "length_penalty": penalty, "max_new_tokens": 8})
    assert str(refused.value) == (
        f"length_penalty {penalty:g} makes length ** length_penalty {word} within "
        f"max_new_tokens (8); keep it between -341.3 and 341.3")
    bound = math.log(sys.float_info.max) / math.log(8)
    assert float(8 ** (bound - 1e-9)) < math.inf  # the bound itself is safe
    assert resolve_settings({"num_beams": 2, "length_penalty": 341.0,
                             "max_new_tokens": 8}).length_penalty == 341.0
