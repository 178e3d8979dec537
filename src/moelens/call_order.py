"""The order in which a model's forward reaches its modules, read from the source of its modules' forwards.

A module's children run in the order its forward uses them, which is not always the order they were defined in:
OPT's and BART's attention define ``k_proj``, ``v_proj``, ``q_proj`` and call ``q_proj`` first. moelens reads
values in the order the model computes them (nnsight serves them one after another), so blocks read together
(`save_all` over the blocks of a model converted by `moelens.compress` at its attention projections) must be
visited in that order. Module lists (decoder layers) run in index order.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Iterable

import torch


def in_run_order(model: torch.nn.Module, paths: Iterable[str]) -> list[str]:
    """``paths`` (module names in ``model``) sorted by when the forward reaches them: at each level, siblings by
    when their parent's forward source first runs them, where it runs every sibling among ``paths`` itself
    (definition order otherwise: a child run through a helper method, or only read, is not seen)."""
    paths = list(paths)
    involved: dict[str, set[str]] = {}  # a parent's path -> its children on the way to ``paths``
    for path in paths:
        parts = path.split(".")
        for depth, part in enumerate(parts):
            involved.setdefault(".".join(parts[:depth]), set()).add(part)
    return sorted(paths, key=lambda path: _key(model, path, involved))


def _key(model: torch.nn.Module, path: str, involved: dict[str, set[str]]) -> tuple:
    key, parent, prefix = [], model, []
    for name in path.split("."):
        children = list(parent._modules)
        definition = children.index(name) if name in children else len(children)
        runs = {} if isinstance(parent, CONTAINERS) else _first_runs(type(parent))
        siblings = involved[".".join(prefix)]
        key.append((runs[name] if siblings <= runs.keys() else 0, definition))
        parent, prefix = getattr(parent, name), [*prefix, name]
    return tuple(key)


#: Modules whose children run in index order (or as their holder runs them): their forwards name none.
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


@functools.cache
def _first_runs(module_class: type) -> dict[str, int]:
    """``{attribute: step}``: when ``module_class.forward`` first runs each ``self.<attribute>`` (calls it, its
    ``forward``, an item of it, loops over it or hands it to a call), as a count in evaluation order ({} where
    its source cannot be read). A mere read (``self.text_model.get_input_embeddings()``,
    ``self.decoder.embed_tokens.weight.dtype``) runs nothing and is not counted."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(module_class.forward)))
    except (OSError, TypeError, SyntaxError):
        return {}
    runs = _Runs()
    runs.visit(tree)
    return runs.first


class _Runs(ast.NodeVisitor):
    """Walks a forward's syntax in evaluation order, noting the first run of each ``self.<child>``: a call counts
    after its arguments (``self.late(self.early(x))`` runs ``early`` first)."""

    def __init__(self) -> None:
        self.first: dict[str, int] = {}

    def _ran(self, name: str) -> None:
        self.first.setdefault(name, len(self.first))

    def visit_Call(self, node: ast.Call) -> None:
        for part in (*node.args, *node.keywords):
            self.visit(part)
        for argument in (*node.args, *(keyword.value for keyword in node.keywords)):  # checkpoint(self.layer, x)
            if _self_child(argument) is not None:
                self._ran(_self_child(argument))
        called = _self_child(node.func)  # self.x(...), self.x[i](...)
        if called is None and isinstance(node.func, ast.Attribute) and node.func.attr == "forward":
            called = _self_child(node.func.value)  # self.x.forward(...)
        if called is not None:
            self._ran(called)
        else:
            self.visit(node.func)

    def visit_For(self, node: ast.For) -> None:
        looped = _self_child(node.iter)  # for layer in self.layers
        if looped is not None:
            self._ran(looped)
        self.generic_visit(node)


def _self_child(node: ast.AST) -> str | None:
    """``x`` of ``self.x`` or ``self.x[...]``, else None."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None
