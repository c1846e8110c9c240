"""Read the values of a HyperPyYAML file (``cosyvoice2.yaml``) without executing anything.

HyperPyYAML tags such as ``!new:pkg.Class`` or ``!apply:torch.manual_seed`` would import and run
code when loaded with the hyperpyyaml package. Here every tagged node becomes a plain ``Tagged``
record (kind, target, arguments), and ``!ref`` expressions are resolved to values, so the loader can
read hyperparameters and decide itself which of our own classes to build.
"""

import ast
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class Tagged:
    """A ``!kind:target`` node: ``kwargs`` for a mapping body, ``args`` for a sequence or scalar body."""

    kind: str
    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    args: list[Any] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return self.kwargs[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.kwargs.get(key, default)


@dataclass
class _Ref:
    expr: str
    copy: bool = False


class _Loader(yaml.SafeLoader):
    pass


def _construct_body(loader: yaml.SafeLoader, node: yaml.Node) -> tuple[dict, list]:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True), []
    if isinstance(node, yaml.SequenceNode):
        return {}, loader.construct_sequence(node, deep=True)
    value = loader.construct_scalar(node)
    return {}, ([] if value == "" else [yaml.safe_load(value)])


def _tagged(kind: str):
    def construct(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Tagged:
        kwargs, args = _construct_body(loader, node)
        return Tagged(kind, suffix, kwargs, args)

    return construct


for _kind in ("new", "name", "apply", "module", "include"):
    _Loader.add_multi_constructor(f"!{_kind}:", _tagged(_kind))
_Loader.add_constructor("!ref", lambda loader, node: _Ref(loader.construct_scalar(node)))
_Loader.add_constructor("!copy", lambda loader, node: _Ref(loader.construct_scalar(node), copy=True))
_Loader.add_constructor(
    "!tuple", lambda loader, node: tuple(yaml.safe_load(f"[{loader.construct_scalar(node)}]"))
)
_Loader.add_constructor("!placeholder", lambda loader, node: None)

_REF = re.compile(r"<([^<>]+)>")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
}


def _arith(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_arith(node.operand)
    raise ValueError("not plain arithmetic")


def _lookup(root: dict, path: str) -> Any:
    value: Any = root
    for part in re.findall(r"[^.\[\]]+", path):
        value = value[part] if isinstance(value, dict | Tagged) else value[int(part)]
    return value


class _Resolver:
    def __init__(self, root: dict):
        self.root = root
        self.active: set[str] = set()

    def ref(self, ref: _Ref) -> Any:
        names = _REF.findall(ref.expr)
        if len(names) == 1 and ref.expr.strip() == f"<{names[0]}>":
            return self.value_of(names[0])
        values = {name: self.value_of(name) for name in names}
        text = _REF.sub(lambda m: repr(values[m.group(1)]), ref.expr)
        try:
            return _arith(ast.parse(text, mode="eval"))
        except (ValueError, SyntaxError):
            # HyperPyYAML treats any other expression as string interpolation.
            return _REF.sub(lambda m: str(values[m.group(1)]), ref.expr)

    def value_of(self, path: str) -> Any:
        if path in self.active:
            raise ValueError(f"circular !ref through <{path}>")
        self.active.add(path)
        try:
            return self.resolve(_lookup(self.root, path))
        except (KeyError, IndexError) as e:
            raise ValueError(f"!ref <{path}> names no value in the yaml") from e
        finally:
            self.active.discard(path)

    def resolve(self, value: Any) -> Any:
        if isinstance(value, _Ref):
            return self.ref(value)
        if isinstance(value, Tagged):
            return Tagged(value.kind, value.target, self.resolve(value.kwargs), self.resolve(value.args))
        if isinstance(value, dict):
            return {k: self.resolve(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        return value


def read_hyperyaml(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse a HyperPyYAML file into plain values and ``Tagged`` records; nothing is imported or run.

    ``overrides`` replace top-level keys before references are resolved (as hyperpyyaml's
    ``overrides`` argument does). Raises ``ValueError`` for a dangling or circular ``!ref``.
    """
    root = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_Loader) or {}
    root.update(overrides or {})
    return _Resolver(root).resolve(root)
