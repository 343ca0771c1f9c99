"""Shared `--NAME=value` overrides for every script's module-level constants, resolved once into one object.

Each script keeps its settings as UPPER_CASE constants at the top (nanoGPT style); its `main(argv)` calls
`settings = resolve(globals(), argv)` once and passes `settings` (a read-only `Settings`: `settings.LR` or
`settings["LR"]`) down. The module's constants are never rewritten, so they always mean the defaults and `main()` can
run twice in one process. Then, for any constant `FOO_BAR`:
    python script.py --FOO_BAR=3        # exact name
    python script.py --foo-bar 3        # the same, argparse style
    python script.py --overwrite        # a bare flag sets a bool constant to True
    python script.py --overwrite false  # ... unless a bool word (1/0, true/false, yes/no, on/off) follows it
    python script.py a.csv b.csv        # positional words go to the constant named by `positional`
    python script.py --help             # lists every constant with its default and comment

An unknown name is a one-line error with the nearest names ("did you mean --TOTAL_STEPS?"), a value of the wrong
type one naming the setting, the value and the type it needs (exit 2); `--help` lists every name. A setting with a
fixed set of values (`choices`) lists those values. Float settings must be finite (nan, inf and numbers too large
for a float are refused).
The value's type comes from the constant's default (or its annotation when the default is None).

Presets are data: `resolve(..., presets={"MODEL_ID": {"tiny": {...}}})` replaces the defaults of the names in the
preset, unless given on the command line, when MODEL_ID resolves to "tiny"; `--help` lists every preset.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path

from tes_grpo.run.fileio import atomic_write_text

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"none", "null"}
_SIMPLE = (bool, int, float, str, Path, list, tuple, type(None))


class ConfigError(ValueError):
    """A bad override: unknown name or a value that does not fit the constant's type."""

def constants_of(namespace: dict) -> dict:
    """The overridable constants of a module namespace: UPPER_CASE names with simple values."""
    return {
        name: value
        for name, value in namespace.items()
        if re.fullmatch(r"[A-Z][A-Z0-9_]*", name) and isinstance(value, _SIMPLE)
    }


def _annotation_types(annotation) -> tuple:
    if isinstance(annotation, str):  # `from __future__ import annotations` keeps them as text
        names = {"int": int, "float": float, "str": str, "bool": bool, "Path": Path}
        return tuple(t for key, t in names.items() if re.search(rf"\b{key}\b", annotation))
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(a for a in args if a is not type(None))
    return (annotation,) if isinstance(annotation, type) else ()


def did_you_mean(word: str, names, prefix: str = "") -> str:
    """" (did you mean --A or --B?)" for the names closest to a misspelt `word`, "" when none is close; names are
    compared as written in upper case with underscores, so `--total-step` finds TOTAL_STEPS."""
    key = word.upper().replace("-", "_")
    close = difflib.get_close_matches(key, list(names), n=2, cutoff=0.75)
    return f" (did you mean {' or '.join(prefix + name for name in close)}?)" if close else ""


def unknown_setting(key: str, names) -> str:
    """The one line for an unknown --key: the nearest names, never the whole list (--help has it)."""
    return f"unknown setting --{key}{did_you_mean(key, names, '--')}; --help lists every setting"


_KINDS = {int: "a whole number", float: "a finite number", bool: "one of 1/0, true/false, yes/no, on/off"}


def parse_bool(name: str, text: str) -> bool:
    """A yes/no word (1/0, true/false, yes/no, on/off, any case) as a bool; ConfigError naming `name` otherwise."""
    low = str(text).strip().lower()
    if low in _TRUE or low in _FALSE:
        return low in _TRUE
    raise ConfigError(f"{name}={text!r}: expected one of 1/0, true/false, yes/no, on/off")


def check_choices(values: Mapping, choices: Mapping) -> None:
    """ConfigError naming the setting, its value and the valid values when a setting with a fixed set of values
    (choices: NAME -> allowed values) has another."""
    for name, allowed in choices.items():
        if name in values and values[name] not in allowed:
            raise ConfigError(f"--{name}={values[name]!r}: must be one of {', '.join(map(str, allowed))}")


def convert_value(name: str, text: str, default, annotation=None, allow_nan: bool = False):
    """Turns the override text into the type of `default` (or of `annotation` when default is None). Floats must be
    finite; allow_nan lets a setting that gives nan a meaning (train_grpo's INVALID_REWARD) take "nan"."""
    kind = type(default)
    if default is None:
        if text.strip().lower() in _NONE:
            return None
        candidates = _annotation_types(annotation) if annotation is not None else (str,)
        kind = candidates[0] if candidates else str
    shown = text if len(text) <= 40 else text[:40] + "..."
    if kind in (list, tuple):
        inner = type(default[0]) if default else str
        items = [item for item in text.split(",") if item != ""]
        if inner in (int, float):
            try:
                items = [_convert(item, inner, False) for item in items]
            except ValueError as err:
                raise ConfigError(f"--{name}={shown!r}: not a valid {inner.__name__} list ({err}); the default is "
                                  f"{default!r}") from None
        return kind(items)
    try:
        return _convert(text, kind, allow_nan)
    except ValueError as err:
        raise ConfigError(f"--{name}={shown!r}: not a valid {kind.__name__} ({err}); the default is {default!r}"
                          ) from None


def _convert(text: str, kind, allow_nan: bool):
    """text as a `kind`; ValueError saying what the type needs (Python's own wording, "invalid literal for int()
    with base 10", says less)."""
    if kind is bool:
        low = text.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ValueError(f"expected {_KINDS[bool]}")
    if kind is Path:
        return Path(text)
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"expected {_KINDS.get(kind, kind.__name__)}") from None
    if kind is float and not math.isfinite(value) and not (allow_nan and math.isnan(value)):
        raise ValueError("must be a finite number")  # nan, inf, or a number too large for a float ("1e999")
    return value


def _doc_lines(namespace: dict) -> dict:
    """NAME -> its trailing comment in the script's source, for --help."""
    path = namespace.get("__file__")
    if not path or not os.path.exists(path):
        return {}
    comments = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([A-Z][A-Z0-9_]*)\s*(?::[^=]+)?=.*?#\s*(.+)$", line)
        if match:
            comments.setdefault(match.group(1), match.group(2).strip())
    return comments


def usage(namespace: dict, positional: str | None = None, presets: dict | None = None,
          choices: Mapping | None = None) -> str:
    script = Path(namespace.get("__file__", "script.py")).name
    doc = (namespace.get("__doc__") or "").strip()
    comments = _doc_lines(namespace)
    choices = choices or {}
    lines = [doc, "", f"usage: python {script} [--NAME=value ...]" + (f" [{positional} ...]" if positional else ""), ""]
    for name, value in constants_of(namespace).items():
        allowed = f" [{' | '.join(map(str, choices[name]))}]" if name in choices else ""
        lines.append(f"  {f'--{name}={value!s}':<40} {comments.get(name, '')}{allowed}".rstrip())
    for key, by_value in (presets or {}).items():
        for value, preset in by_value.items():
            lines += ["", f"preset {key}={value} (replaces these defaults unless given):"]
            lines += [f"  --{name}={preset_value}" for name, preset_value in preset.items()]
    return "\n".join(lines)


def parse_overrides(argv: list[str], defaults: dict, annotations: dict | None = None,
                    positional: str | None = None, allow_nan=()) -> dict:
    """Returns {NAME: converted value} for the overrides in argv; raises ConfigError on bad input. allow_nan: names
    of float settings that may be nan."""
    annotations = annotations or {}
    lookup = {name.lower().replace("_", "-"): name for name in defaults}
    result: dict = {}
    words: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            words.append(arg)
            continue
        key, has_value, text = arg[2:].partition("=")
        name = key if key in defaults else lookup.get(key.lower().replace("_", "-"))
        if name is None:
            raise ConfigError(unknown_setting(key, defaults))
        default = defaults[name]
        if not has_value:
            if isinstance(default, bool):
                # `--overwrite false`: a bool word right after a bare flag is its value, not a positional word
                following = argv[i].strip().lower() if i < len(argv) else ""
                if following in _TRUE or following in _FALSE:
                    result[name] = following in _TRUE
                    i += 1
                else:
                    result[name] = True
                continue
            # a following `--NAME...` word is the next setting, never this one's value (a forgotten value)
            if i >= len(argv) or argv[i].startswith("--"):
                raise ConfigError(f"--{key} needs a value (--{name}=value)")
            text = argv[i]
            i += 1
        result[name] = convert_value(name, text, default, annotations.get(name), allow_nan=name in allow_nan)
    if words:
        if positional is None:
            raise ConfigError(f"unexpected argument {words[0]!r}: settings take the form --NAME=value; --help lists "
                              "every setting")
        default = defaults[positional]
        result[positional] = type(default)(words) if isinstance(default, (list, tuple)) else words[0]
    return result


class SettingsError(ValueError):
    """Settings that cannot work (together), found after parsing; a script prints it as `error: ...`, exits 1."""

class Settings(Mapping):
    """A script's resolved settings: read-only, by attribute (`settings.LR`) or key (`settings["LR"]`).

    given: the names set on the command line; preset: the names a preset replaced (name -> (default, preset value)).
    """
    def __init__(self, values: dict, given=(), preset: dict | None = None):
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "given", frozenset(given))
        object.__setattr__(self, "preset", dict(preset or {}))

    def __getattr__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no setting {name}; valid: {', '.join(sorted(self._values))}") from None

    def __setattr__(self, name, value):
        raise AttributeError("settings are read-only; use settings.replace(NAME=value)")

    def __getitem__(self, name: str):
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Settings({self._values!r})"

    def replace(self, **changes) -> "Settings":
        """A copy with some values changed; unknown names raise KeyError listing the valid ones."""
        unknown = sorted(set(changes) - set(self._values))
        if unknown:
            raise KeyError(f"unknown setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(self._values))}")
        return Settings({**self._values, **changes}, self.given | set(changes), self.preset)


def settings_from(namespace: dict, overrides: dict | None = None, presets: dict | None = None,
                  given=None, choices: Mapping | None = None) -> Settings:
    """The namespace's constants with overrides (NAME=value) applied, then any matching preset for names not given.

    Unknown override names, and values outside `choices` (NAME -> allowed values), raise ConfigError listing the
    valid ones (for tests and other Python callers).
    """
    defaults = constants_of(namespace)
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}{did_you_mean(unknown[0], defaults)}. Valid names: "
                          f"{', '.join(sorted(defaults))}")
    given = set(overrides) if given is None else set(given)
    values = {**defaults, **overrides}
    applied = {}
    for key, by_value in (presets or {}).items():
        for name, preset_value in by_value.get(values.get(key), {}).items():
            if name not in given:
                applied[name] = (values[name], preset_value)
                values[name] = preset_value
    check_choices(values, choices or {})
    return Settings(values, given, applied)


def resolve(namespace: dict, argv: list[str] | None = None, positional: str | None = None,
            presets: dict | None = None, allow_nan=(), choices: Mapping | None = None) -> Settings:
    """The script's settings from its constants and the command line (the one way every script reads them).

    Prints the constants (and presets, and each choice setting's values) and exits 0 on --help; prints one line
    `error: ...` and exits 2 on an unknown name (with the nearest names), a value of the wrong type (naming the
    type it needs), or a value outside `choices` (listing the valid values). The namespace itself is left as
    written.
    """
    argv = sys.argv[1:] if argv is None else argv
    defaults = constants_of(namespace)
    if positional is not None and positional not in defaults:
        raise KeyError(f"positional constant {positional} is not defined")
    if any(arg in ("-h", "--help") for arg in argv):
        print(usage(namespace, positional, presets, choices))
        raise SystemExit(0)
    try:
        overrides = parse_overrides(argv, defaults, namespace.get("__annotations__", {}), positional, allow_nan)
        return settings_from(namespace, overrides, presets, choices=choices)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def save_config(config: dict, path: str | os.PathLike) -> Path:
    """Writes the resolved constants as JSON (atomically) so a run folder records how it was made."""
    config = dict(config)
    serialisable = {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
                    for k, v in config.items()}
    return atomic_write_text(path, json.dumps(serialisable, indent=2, sort_keys=True) + "\n")


__all__ = ["ConfigError", "Settings", "check_choices", "constants_of", "convert_value", "parse_bool",
           "parse_overrides", "resolve", "save_config", "settings_from", "usage"]
