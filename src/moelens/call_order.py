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

#: Where a child used nowhere in its parent's forward source sorts: after those it uses, in definition order.
UNSEEN = 1 << 30


def in_run_order(model: torch.nn.Module, paths: Iterable[str]) -> list[str]:
    """``paths`` (module names in ``model``) sorted by when the forward reaches them: at each level, siblings by
    their first use in their parent's forward source (definition order where it has none to read)."""
    return sorted(paths, key=lambda path: _key(model, path))


def _key(model: torch.nn.Module, path: str) -> tuple:
    key, parent = [], model
    for name in path.split("."):
        children = list(parent._modules)
        definition = children.index(name) if name in children else len(children)
        if isinstance(parent, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)):
            key.append((0, definition))
        else:
            key.append((_first_uses(type(parent)).get(name, UNSEEN), definition))
        parent = getattr(parent, name)
    return tuple(key)


@functools.cache
def _first_uses(module_class: type) -> dict[str, int]:
    """``{attribute: step}``: when ``module_class.forward`` first calls (or otherwise reads) each ``self.<attribute>``,
    as a count in evaluation order ({} where its source cannot be read)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(module_class.forward)))
    except (OSError, TypeError, SyntaxError):
        return {}
    uses = _Uses()
    uses.visit(tree)
    return uses.first


class _Uses(ast.NodeVisitor):
    """Walks a forward's syntax in evaluation order: a call of ``self.<child>(...)`` counts after its arguments
    (``self.late(self.early(x))`` runs ``early`` first), any other read of ``self.<child>`` where it stands."""

    def __init__(self) -> None:
        self.first: dict[str, int] = {}

    def _use(self, name: str) -> None:
        self.first.setdefault(name, len(self.first))

    def visit_Call(self, node: ast.Call) -> None:
        called = node.func
        if _is_self_attribute(called):
            for part in (*node.args, *node.keywords):
                self.visit(part)
            self._use(called.attr)
        else:
            self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _is_self_attribute(node):
            self._use(node.attr)
        self.generic_visit(node)


def _is_self_attribute(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
