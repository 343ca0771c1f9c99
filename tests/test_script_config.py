"""script_config: the shared --NAME=value overrides (table-driven)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tes_grpo.run.script_config import (
    ConfigError,
    Settings,
    constants_of,
    convert_value,
    parse_overrides,
    resolve,
    save_config,
    settings_from,
)

DEFAULTS = {"STEPS": 10, "LR": 1e-5, "NAME": "run", "FLAG": False, "ON": True, "OUT": Path("runs/x"),
            "LAYERS": [], "SIZES": [1, 2], "PATHS": [], "LIMIT": None, "RATIO": None, "TAG": None}
ANNOTATIONS = {"LIMIT": "int | None", "RATIO": "float | None"}

# (argv, expected overrides)
GOOD = [
    (["--STEPS=3"], {"STEPS": 3}),  # exact name
    (["--steps", "4"], {"STEPS": 4}),  # lower case, value as the next word
    (["--lr=2e-3"], {"LR": 2e-3}),  # float
    (["--NAME=a b"], {"NAME": "a b"}),  # str keeps spaces
    (["--FLAG"], {"FLAG": True}),  # bare flag sets a bool to True
    (["--ON=off"], {"ON": False}),  # bool words
    (["--FLAG=yes"], {"FLAG": True}),
    (["--OUT=/tmp/y"], {"OUT": Path("/tmp/y")}),  # Path
    (["--LAYERS=7,15,23"], {"LAYERS": ["7", "15", "23"]}),  # list of str (empty default)
    (["--SIZES=3,4"], {"SIZES": [3, 4]}),  # list takes its first item's type
    (["--LAYERS="], {"LAYERS": []}),  # empty list
    (["--LIMIT=5"], {"LIMIT": 5}),  # None default: type from the annotation (int)
    (["--RATIO=0.5"], {"RATIO": 0.5}),  # annotation float
    (["--LIMIT=none"], {"LIMIT": None}),  # back to None
    (["--TAG=abc"], {"TAG": "abc"}),  # None default without annotation: str
    (["a.csv", "b.csv"], {"PATHS": ["a.csv", "b.csv"]}),  # positional words go to the positional constant
    (["--STEPS=1", "x.csv", "--FLAG"], {"STEPS": 1, "PATHS": ["x.csv"], "FLAG": True}),  # mixed order
    ([], {}),
    (["--FLAG", "false"], {"FLAG": False}),  # a bool word after a bare flag is its value, not a positional word
    (["--flag", "TRUE"], {"FLAG": True}),  # any case
    (["--FLAG", "0", "a.csv"], {"FLAG": False, "PATHS": ["a.csv"]}),  # 0/1 too; the next word is positional again
    (["--ON", "off"], {"ON": False}),  # on/off
    (["--FLAG", "no"], {"FLAG": False}),  # yes/no
    (["--FLAG", "a.csv"], {"FLAG": True, "PATHS": ["a.csv"]}),  # not a bool word: the flag alone, then a path
    (["--FLAG", "--STEPS=2"], {"FLAG": True, "STEPS": 2}),  # another setting follows
    (["--FLAG=false", "true"], {"FLAG": False, "PATHS": ["true"]}),  # with =value the next word is positional
    (["--LR=1e300"], {"LR": 1e300}),  # large but finite
]


@pytest.mark.parametrize("argv, expected", GOOD)
def test_good_overrides(argv, expected):
    assert parse_overrides(argv, DEFAULTS, ANNOTATIONS, positional="PATHS") == expected


# (argv, positional constant, words the error must contain)
BAD = [
    (["--STEP=3"], "PATHS", ["unknown setting --STEP (did you mean --STEPS?)"]),  # a typo: the nearest name
    (["--ste-ps=3"], "PATHS", ["unknown setting --ste-ps (did you mean --STEPS?)"]),  # argparse style too
    (["--XYZZY=3"], "PATHS", ["unknown setting --XYZZY; --help lists every setting"]),  # nothing near: no guess
    (["--STEPS=three"], "PATHS", ["--STEPS='three': not a valid int (expected a whole number); the default is 10"]),
    (["--LR=fast"], "PATHS", ["not a valid float"]),
    (["--FLAG=maybe"], "PATHS", ["not a valid bool", "true/false"]),
    (["--LIMIT=1.5"], "PATHS", ["not a valid int"]),  # annotation int | None
    (["--SIZES=1,x"], "PATHS", ["--SIZES='1,x': not a valid int list (expected a whole number"]),  # a list item
    (["--STEPS"], "PATHS", ["--STEPS needs a value"]),  # non-bool without a value
    (["--STEPS", "--LR=0.1"], "PATHS", ["--STEPS needs a value"]),  # the next setting is not its value
    (["--NAME", "--LR=0.1"], "PATHS", ["--NAME needs a value"]),  # not even for a text setting
    (["stray.csv"], None, ["unexpected argument 'stray.csv'", "--NAME=value"]),  # positional word, none expected
    (["--LR=nan"], "PATHS", ["--LR='nan'", "must be a finite number"]),  # NaN would switch comparisons off
    (["--LR=inf"], "PATHS", ["--LR='inf'", "must be a finite number"]),
    (["--LR=-Infinity"], "PATHS", ["must be a finite number"]),
    (["--LR=" + "9" * 400], "PATHS", ["must be a finite number"]),  # overflows to inf when parsed
    (["--RATIO=nan"], "PATHS", ["--RATIO='nan'", "must be a finite number"]),  # annotation float | None
    (["--STEPS=" + "9" * 5000], "PATHS", ["not a valid int"]),  # over Python's int-digits limit: an error, no crash
]


@pytest.mark.parametrize("argv, positional, words", BAD)
def test_bad_overrides(argv, positional, words):
    with pytest.raises(ConfigError) as err:
        parse_overrides(argv, DEFAULTS, ANNOTATIONS, positional=positional)
    for word in words:
        assert word in str(err.value)
    # one short line, never the list of every name (--help has it)
    assert "\n" not in str(err.value) and "Valid names" not in str(err.value) and len(str(err.value)) < 160


def namespace():
    return {"__file__": __file__, "__doc__": "Test script.", "__annotations__": dict(ANNOTATIONS), **DEFAULTS,
            "MODE": "auto", "lower_case": 1, "_PRIVATE": 2, "TABLE": {"a": 1}}


PRESETS = {"NAME": {"tiny": {"STEPS": 2, "LR": 0.1}}}
CHOICES = {"MODE": ("auto", "on", "off")}  # a setting with a fixed set of values

# ---- resolve: (argv, expected values, expected given names, expected preset record) -------------------------------
RESOLVE_CASES = [
    ([], {"STEPS": 10, "NAME": "run", "PATHS": []}, set(), {}),  # defaults
    (["--STEPS=7", "--FLAG", "in.csv"], {"STEPS": 7, "FLAG": True, "PATHS": ["in.csv"]}, {"STEPS", "FLAG", "PATHS"},
     {}),  # overrides and a positional word; all of them given
    (["--NAME=tiny"], {"STEPS": 2, "LR": 0.1}, {"NAME"}, {"STEPS": (10, 2), "LR": (1e-5, 0.1)}),  # a preset
    (["--NAME=tiny", "--STEPS=5"], {"STEPS": 5, "LR": 0.1}, {"NAME", "STEPS"}, {"LR": (1e-5, 0.1)}),  # given wins
    (["--FLAG", "false"], {"FLAG": False, "PATHS": []}, {"FLAG"}, {}),  # the bool word is the flag's value
]


@pytest.mark.parametrize("argv, values, given, preset", RESOLVE_CASES)
def test_resolve(argv, values, given, preset):
    ns = namespace()
    before = dict(ns)
    settings = resolve(ns, argv, positional="PATHS", presets=PRESETS)
    assert isinstance(settings, Settings)
    for name, value in values.items():
        assert settings[name] == value and getattr(settings, name) == value
    assert settings.given == given and settings.preset == preset
    assert ns == before  # the namespace's constants are never rewritten
    assert set(settings) == set(constants_of(ns))  # only simple UPPER_CASE constants
    assert "lower_case" not in settings and "_PRIVATE" not in settings and "TABLE" not in settings


# (argv, exit status, words on stdout (0) or stderr (2))
RESOLVE_EXIT_CASES = [
    (["--NOPE=1"], 2, ["error: unknown setting --NOPE; --help lists every setting"]),
    (["--STEPZ=1"], 2, ["error: unknown setting --STEPZ (did you mean --STEPS?)"]),
    (["--STEPS=x"], 2, ["error: --STEPS='x': not a valid int (expected a whole number); the default is 10"]),
    (["--LR=nan"], 2, ["error: --LR='nan'", "finite"]),
    (["--MODE=fast"], 2, ["error: --MODE='fast': must be one of auto, on, off"]),  # a choice setting lists its values
    (["--MODE=on"], None, []),  # a valid choice
    (["--help"], 0, ["Test script.", "--STEPS=10", "--LIMIT=None", "preset NAME=tiny", "--STEPS=2", "--LR=0.1",
                     "--MODE=auto", "[auto | on | off]"]),
    (["-h"], 0, ["usage: python test_script_config.py [--NAME=value ...] [PATHS ...]"]),
]


@pytest.mark.parametrize("argv, code, words", RESOLVE_EXIT_CASES)
def test_resolve_exits(argv, code, words, capsys):
    if code is None:
        assert resolve(namespace(), argv, positional="PATHS", presets=PRESETS, choices=CHOICES).MODE == "on"
        return
    with pytest.raises(SystemExit) as exit_info:
        resolve(namespace(), argv, positional="PATHS", presets=PRESETS, choices=CHOICES)
    assert exit_info.value.code == code
    out, err = capsys.readouterr()
    text = out if code == 0 else err
    for word in words:
        assert word in text, text
    if code:
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


# a real script's 47 settings: a near miss names the setting meant, a wrong type its type and default, in one line
@pytest.mark.parametrize("argv, line", [
    (["--TOTAL_STEP=3"], "error: unknown setting --TOTAL_STEP (did you mean --TOTAL_STEPS?); --help lists every "
                         "setting"),
    (["--total_step", "3"], "error: unknown setting --total_step (did you mean --TOTAL_STEPS?); --help lists every "
                            "setting"),
    (["--TOTAL_STEPS=abc"], "error: --TOTAL_STEPS='abc': not a valid int (expected a whole number); the default is "
                            "200"),
    (["--LR=fast"], "error: --LR='fast': not a valid float (expected a finite number); the default is 5e-05"),
])
def test_a_scripts_misspelt_or_mistyped_setting_is_one_short_line(argv, line, capsys):
    import train_grpo

    with pytest.raises(SystemExit) as exit_info:
        resolve(vars(train_grpo), argv, presets=train_grpo.PRESETS, choices=train_grpo.CHOICES)
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip() == line


def test_resolve_rejects_an_undefined_positional_constant():
    with pytest.raises(KeyError, match="NOPE"):
        resolve(namespace(), [], positional="NOPE")


# ---- Settings: (operation, expected exception and words) ----------------------------------------------------------
def set_attribute(settings):
    settings.STEPS = 3


def set_item(settings):
    settings["STEPS"] = 3


def delete_attribute(settings):
    del settings.STEPS


READ_ONLY_CASES = [
    (set_attribute, AttributeError, "read-only"),  # settings.X = ...
    (set_item, TypeError, "item assignment"),  # settings["X"] = ... (a Mapping, not a dict)
    (delete_attribute, AttributeError, None),
    (lambda s: s.NOPE, AttributeError, "no setting NOPE; valid:"),  # typo: lists the names
    (lambda s: s["NOPE"], KeyError, "NOPE"),
    (lambda s: s.replace(NOPE=1), KeyError, "unknown setting(s) NOPE"),
]


@pytest.mark.parametrize("operation, error, words", READ_ONLY_CASES)
def test_settings_are_read_only(operation, error, words):
    settings = settings_from(namespace(), {"STEPS": 4})
    with pytest.raises(error, match=None if words is None else re.escape(words)):
        operation(settings)
    assert settings.STEPS == 4


def test_settings_replace_returns_a_changed_copy():
    settings = settings_from(namespace(), {"STEPS": 4})
    changed = settings.replace(LR=0.5, NAME="b")
    assert (changed.LR, changed.NAME, changed.STEPS) == (0.5, "b", 4)
    assert (settings.LR, settings.NAME) == (1e-5, "run")  # the original is unchanged
    assert changed.given == {"STEPS", "LR", "NAME"} and settings.given == {"STEPS"}
    assert dict(changed) == {**dict(settings), "LR": 0.5, "NAME": "b"}


def test_settings_from_refuses_unknown_names():
    with pytest.raises(ConfigError, match="unknown setting"):
        settings_from(namespace(), {"NOPE": 1})


def test_convert_value_annotation_object():
    assert convert_value("X", "3", None, int | None) == 3
    assert convert_value("X", "none", None, int | None) is None


def test_save_config_writes_json(tmp_path):
    path = save_config({"OUT": Path("a/b"), "SIZES": (1, 2), "N": 3}, tmp_path / "c" / "config.json")
    assert json.loads(path.read_text()) == {"N": 3, "OUT": "a/b", "SIZES": [1, 2]}


SCRIPTS = ["train_grpo", "step_stream", "calculate_reward", "convert_to_harmony", "test_lora_adapter",
           "export_quantized_model", "run_exported_model", "evaluate_policy", "check_data", "make_series",
           "make_q_dataset", "make_example_data", "export_gguf_adapter"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_scripts_settings_are_the_constants_it_writes(script):
    """An UPPER_CASE name imported into a script would become a setting (--help, --NAME=value, train_config.json)."""
    import importlib

    module = importlib.import_module(script)
    source = Path(module.__file__).read_text(encoding="utf-8")
    written = set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*(?::[^=\n]+)?=", source, flags=re.MULTILINE))
    assert set(constants_of(vars(module))) <= written
