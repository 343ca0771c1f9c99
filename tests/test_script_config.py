"""script_config: the shared --NAME=value overrides (table-driven)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tes_grpo.script_config import ConfigError, configure, constants_of, convert_value, parse_overrides, save_config

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
]


@pytest.mark.parametrize("argv, expected", GOOD)
def test_good_overrides(argv, expected):
    assert parse_overrides(argv, DEFAULTS, ANNOTATIONS, positional="PATHS") == expected


# (argv, positional constant, words the error must contain)
BAD = [
    (["--STEP=3"], "PATHS", ["unknown setting --STEP", "Valid names:", "STEPS", "LR", "FLAG"]),  # typo lists names
    (["--STEPS=three"], "PATHS", ["--STEPS='three'", "not a valid int"]),  # wrong type
    (["--LR=fast"], "PATHS", ["not a valid float"]),
    (["--FLAG=maybe"], "PATHS", ["not a valid bool", "true/false"]),
    (["--LIMIT=1.5"], "PATHS", ["not a valid int"]),  # annotation int | None
    (["--SIZES=1,x"], "PATHS", ["not a valid int"]),  # list item of the wrong type
    (["--STEPS"], "PATHS", ["--STEPS needs a value"]),  # non-bool without a value
    (["stray.csv"], None, ["unexpected argument 'stray.csv'", "Valid names:"]),  # positional word, none expected
]


@pytest.mark.parametrize("argv, positional, words", BAD)
def test_bad_overrides(argv, positional, words):
    with pytest.raises(ConfigError) as err:
        parse_overrides(argv, DEFAULTS, ANNOTATIONS, positional=positional)
    for word in words:
        assert word in str(err.value)


def namespace():
    return {"__file__": __file__, "__doc__": "Test script.", "__annotations__": dict(ANNOTATIONS), **DEFAULTS,
            "lower_case": 1, "_PRIVATE": 2, "TABLE": {"a": 1}}


def test_configure_updates_namespace_and_returns_constants():
    ns = namespace()
    config = configure(ns, ["--STEPS=7", "--FLAG", "in.csv"], positional="PATHS")
    assert ns["STEPS"] == 7 and ns["FLAG"] is True and ns["PATHS"] == ["in.csv"]
    assert config == constants_of(ns)
    assert "lower_case" not in config and "_PRIVATE" not in config and "TABLE" not in config  # only simple constants


@pytest.mark.parametrize("argv", [["--NOPE=1"], ["--STEPS=x"]])
def test_configure_exits_2_with_message(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        configure(namespace(), argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_configure_help_lists_constants_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        configure(namespace(), ["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("Test script.") and "--STEPS=10" in out and "--LIMIT=None" in out


def test_convert_value_annotation_object():
    assert convert_value("X", "3", None, int | None) == 3
    assert convert_value("X", "none", None, int | None) is None


def test_save_config_writes_json(tmp_path):
    path = save_config({"OUT": Path("a/b"), "SIZES": (1, 2), "N": 3}, tmp_path / "c" / "config.json")
    assert json.loads(path.read_text()) == {"N": 3, "OUT": "a/b", "SIZES": [1, 2]}
