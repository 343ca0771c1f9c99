"""The package read as syntax (no module of it imported): where its code names, assigns into or rebinds a library's
internals. tests/test_patches.py holds tes_grpo/ to the patch registry with it; tests/test_package_scan.py checks
each rule on planted code.

Three kinds of finding, each with its file, line and qualified name (`sampling.decode_math.head_logits`, the form of
registry.Patched's `patch`):
- `versioned_definitions`: a function, method or class whose docstring names a library with a version ("TRL 1.16",
  "transformers 5.17-5.24", "peft 0.21"): code that says it follows a library version, which the registry must hold;
- `library_assignments`: an assignment into a library's module, class or registry (`trl_utils._use_triton = ...`,
  `ALL_ATTENTION_FUNCTIONS["flex_attention"] = ...`, setattr on one, or into a local name bound to one): a patch;
- `instance_bindings`: a method bound on an object (`x.forward = types.MethodType(...)`, `model.generate = ...`,
  `trainer._compute_loss = ...`): a function made on the spot or one of the scanned module's own (MethodType, partial,
  lambda, `__get__`, a def's name), or any value under the name of a method of the library classes the product runs
  (LIBRARY_CLASSES). A class swap (`module.__class__ = Variant`) is not one: the methods come from a class.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# the libraries whose modules and classes the product must not assign into outside a registered patch
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "vllm", "triton")
# a library named with a version ("TRL 1.16's", "transformers 5.17-5.24", "torch >= 2.11"); Triton is a compiler
# the kernels are written in, not code the product mirrors, so naming its version commits to nothing here
VERSIONED = re.compile(r"\b(?:py)?(torch|transformers|trl|peft|accelerate|vllm)\b\s*(?:[<>=]=?\s*)?v?(\d+\.\d+)",
                       re.IGNORECASE)
# the library classes whose methods no object of the product may have rebound (their bases' methods included)
LIBRARY_CLASSES = ("torch.nn:Module", "transformers:PreTrainedModel", "transformers:GenerationMixin",
                   "transformers:PreTrainedConfig", "transformers:Trainer", "transformers:TrainerCallback",
                   "trl:GRPOTrainer", "trl.generation.vllm_generation:VLLMGeneration", "peft:PeftModel",
                   "peft.tuners.tuners_utils:BaseTuner", "peft.tuners.lora.layer:Linear", "accelerate:Accelerator")
# calls that make a callable to bind: types.MethodType(f, obj), functools.partial(f, ...), ...
_BINDERS = {"MethodType", "partial", "partialmethod"}
_MUTATORS = {"__setitem__", "__delitem__", "update", "setdefault"}  # calls that assign into what they are called on


@dataclass(frozen=True)
class Finding:
    path: str  # relative to the repository
    line: int
    qualified: str  # relative to tes_grpo, as registry.Patched.patch names code
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.qualified}: {self.what}"


@dataclass(frozen=True)
class Module:
    """One parsed module: its file (relative to the repository), dotted name relative to tes_grpo ("" for the
    package's own __init__) and syntax tree."""

    path: str
    name: str
    tree: ast.Module

    def qualify(self, scope: tuple[str, ...]) -> str:
        return ".".join(part for part in (self.name, *scope) if part)


def package_modules(repo: Path, package: str = "tes_grpo") -> list[Module]:
    """Every module under repo/package, parsed."""
    modules = []
    for path in sorted((repo / package).rglob("*.py")):
        parts = path.relative_to(repo / package).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        modules.append(parse(path.read_text(encoding="utf-8"), str(path.relative_to(repo)), ".".join(parts)))
    return modules


def parse(source: str, path: str = "planted.py", name: str = "planted") -> Module:
    return Module(path, name, ast.parse(source))


def _definitions(node: ast.AST, scope: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], ast.AST]]:
    """(scope, node) of every function and class under `node`, scope ending with the definition's own name."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield (*scope, child.name), child
            yield from _definitions(child, (*scope, child.name))
        else:
            yield from _definitions(child, scope)


def versioned_definitions(module: Module) -> Iterator[Finding]:
    """Functions, methods and classes whose docstrings name a library version."""
    for scope, node in _definitions(module.tree):
        named = sorted({f"{lib} {version}" for lib, version in VERSIONED.findall(ast.get_docstring(node) or "")})
        if named:
            yield Finding(module.path, node.lineno, module.qualify(scope), "docstring names " + ", ".join(named))


def _root(node: ast.AST) -> str | None:
    """The name an attribute/subscript chain starts from (`a` of `a.b[c].d`, of `vars(a)[k]`, of `getattr(a, k).d`),
    or None (a call's result, a literal)."""
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("vars", "getattr")
              and node.args):
            node = node.args[0]
        else:
            return node.id if isinstance(node, ast.Name) else None


def _imported_library_names(body: list[ast.stmt]) -> set[str]:
    """Names the statements of one scope (not nested functions') bind to a library's modules, classes or objects."""
    names = set()
    for node in _scope_nodes(body):
        if isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names
                         if alias.name.split(".")[0] in LIBRARIES)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in LIBRARIES:
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _scope_nodes(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of a scope's statements, not descending into nested functions and classes."""
    stack = list(reversed(body))
    while stack:  # depth first, in the order of the source
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _aliases(body: list[ast.stmt], library: set[str]) -> set[str]:
    """Names a scope binds to a library object by reading it (`registry = masking_utils.ALL_MASK...`, getattr and
    vars included; not another call's result), repeated until no new one comes (an alias of an alias)."""
    found = set(library)
    while True:
        new = {target.id for node in _scope_nodes(body) if isinstance(node, ast.Assign)
               and _root(node.value) in found for target in node.targets if isinstance(target, ast.Name)} - found
        if not new:
            return found
        found |= new


def _targets(node: ast.AST) -> Iterator[tuple[ast.AST, ast.AST | None]]:
    """(target, assigned value or None) of every assignment a statement or call makes: =, +=, annotated, del,
    setattr/delattr, and the mutating calls (_MUTATORS) on what they are called on."""
    def flat(target):
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                yield from flat(element)
        elif isinstance(target, ast.Starred):
            yield from flat(target.value)
        else:
            yield target

    if isinstance(node, ast.Assign):
        for target in node.targets:
            yield from ((t, node.value) for t in flat(target))
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
        yield node.target, node.value
    elif isinstance(node, ast.Delete):
        for target in node.targets:
            yield from ((t, None) for t in flat(target))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
        if len(node.args) >= 2:
            name = node.args[1]
            attribute = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else "?"
            yield (ast.Attribute(value=node.args[0], attr=attribute, lineno=node.lineno),
                   node.args[2] if len(node.args) > 2 else None)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
        yield ast.Subscript(value=node.func.value, slice=ast.Constant(None), lineno=node.lineno), None


def _scopes(module: Module) -> Iterator[tuple[tuple[str, ...], list[ast.stmt], set[str], ast.ClassDef | None]]:
    """(scope, statements, library names visible there, the class it is in or None) of the module and of every
    function and class in it."""
    top = _aliases(module.tree.body, _imported_library_names(module.tree.body))
    yield (), module.tree.body, top, None

    def walk(node, scope, visible, klass):
        for inner, child in _definitions(node, scope):
            if len(inner) != len(scope) + 1:
                continue  # nested deeper: reached from its own parent
            names = _aliases(child.body, visible | _imported_library_names(child.body))
            within = child if isinstance(child, ast.ClassDef) else klass
            yield inner, child.body, names, within
            yield from walk(child, inner, names, within)

    yield from walk(module.tree, (), top, None)


def library_assignments(module: Module, registered: set[str]) -> Iterator[Finding]:
    """Assignments into a library's module, class or registry outside a registered patch (a scope whose qualified
    name, or an enclosing one's, is a registered patch)."""
    for scope, body, library, _ in _scopes(module):
        qualified = module.qualify(scope)
        if any(module.qualify(scope[:i]) in registered for i in range(1, len(scope) + 1)):
            continue
        for node in _scope_nodes(body):
            for target, _ in _targets(node):
                if isinstance(target, (ast.Attribute, ast.Subscript)) and _root(target) in library:
                    yield Finding(module.path, target.lineno, qualified or module.name,
                                  f"assigns into a library's module, class or registry: {ast.unparse(target)}")


def library_method_names(classes: tuple[str, ...] = LIBRARY_CLASSES) -> set[str]:
    """Names of the methods (functions, static and class methods) the given library classes and their bases define,
    `object`'s left out."""
    names = set()
    for spec in classes:
        module, _, qualified = spec.partition(":")
        cls = importlib.import_module(module)
        for part in qualified.split("."):
            cls = getattr(cls, part)
        for klass in cls.__mro__[:-1]:
            names.update(name for name, value in vars(klass).items()
                         if callable(value) or isinstance(value, (staticmethod, classmethod)))
    return names


def _own_callables(module: Module) -> set[str]:
    """Names of the functions and classes the module defines, at any depth."""
    return {scope[-1] for scope, _ in _definitions(module.tree)}


def _makes_callable(value: ast.AST | None, own: set[str]) -> str | None:
    """How `value` makes a callable to bind (None: it does not, as far as syntax tells)."""
    if isinstance(value, ast.Lambda):
        return "a lambda"
    if isinstance(value, (ast.Name, ast.Attribute)):
        name = value.id if isinstance(value, ast.Name) else value.attr
        return f"the module's own {name}" if name in own else None
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in _BINDERS or name == "__get__":
            return ast.unparse(func)
        if isinstance(func, ast.Call) and _makes_callable(func, own) is None:  # functools.wraps(f)(g)
            inner = func.func
            if (inner.id if isinstance(inner, ast.Name) else getattr(inner, "attr", None)) == "wraps":
                return "functools.wraps(...)(...)"
    return None


def instance_bindings(module: Module, method_names: set[str]) -> Iterator[Finding]:
    """Methods bound on objects (see the module docstring): attribute assignments (setattr, `obj.__dict__[name]`,
    `vars(obj)[name]` too) whose value makes a callable, or whose name is one of `method_names` (on `self` and `cls`
    only the latter, and only in a subclass of a library class: another class's attributes are its own)."""
    own = _own_callables(module)
    for scope, body, library, klass in _scopes(module):
        subclass = klass is not None and any(_root(base) in library for base in klass.bases)
        for node in _scope_nodes(body):
            for target, value in _targets(node):
                owner, name = None, None
                if isinstance(target, ast.Attribute):
                    owner, name = target.value, target.attr
                elif (isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant)
                      and isinstance(target.slice.value, str)):
                    inner = target.value
                    if isinstance(inner, ast.Attribute) and inner.attr == "__dict__":
                        owner, name = inner.value, target.slice.value
                    elif (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "vars"
                          and inner.args):
                        owner, name = inner.args[0], target.slice.value
                if owner is None or name == "__class__" or _root(owner) in library:
                    continue  # a class swap; an assignment into a library's module or class is library_assignments'
                bare_self = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
                if (bare_self and not subclass) or (isinstance(owner, ast.Name) and owner.id in own):
                    continue  # an attribute of the module's own object, function or class
                how = None if bare_self else _makes_callable(value, own)
                if name in method_names:
                    how = how or f"under a library method's name ({name})"
                if how:
                    yield Finding(module.path, target.lineno, module.qualify(scope) or module.name,
                                  f"binds a method on an object: {ast.unparse(target)} = "
                                  f"{ast.unparse(value) if value is not None else '(deleted)'} ({how})")
