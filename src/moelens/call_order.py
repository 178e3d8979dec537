"""The order in which a model's forward reaches its modules, read from the source of its modules' forwards.

A module's children run in the order its forward uses them, which is not always the order they were defined in:
OPT's and BART's attention define ``k_proj``, ``v_proj``, ``q_proj`` and call ``q_proj`` first. moelens reads
values in the order the model computes them (nnsight serves them one after another), so blocks read together
(`save_all` over the blocks of a model converted by `moelens.compress` at its attention projections) must be
visited in that order. Module lists (decoder layers) run in index order; lists that one loop runs item by item
together (XLM's ``self.attentions[i]`` and ``self.ffns[i]`` in ``for i in range(self.n_layers)``) run interleaved:
item 0 of each in the order the loop's body runs them, then item 1 of each, and so on.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Iterable, NamedTuple

import torch


def in_run_order(model: torch.nn.Module, paths: Iterable[str]) -> list[str]:
    """``paths`` (module names in ``model``) sorted by when the forward reaches them: at each level, siblings by
    when their parent's forward source first runs them, where it runs every sibling among ``paths`` itself
    (definition order otherwise: a child run through a helper method, or only read, is not seen); items of
    lists one loop runs together by item, then by when the loop's body runs their list."""
    paths = list(paths)
    involved: dict[str, set[str]] = {}  # a parent's path -> its children on the way to ``paths``
    for path in paths:
        parts = path.split(".")
        for depth, part in enumerate(parts):
            involved.setdefault(".".join(parts[:depth]), set()).add(part)
    return sorted(paths, key=lambda path: _key(model, path, involved))


def _key(model: torch.nn.Module, path: str, involved: dict[str, set[str]]) -> tuple:
    """The sort key of ``path``: one `_sibling_key` for each module on it, outermost first."""
    key, parent, parts = [], model, path.split(".")
    for depth, name in enumerate(parts):
        child = getattr(parent, name)
        runs = {} if isinstance(parent, CONTAINERS) else _first_runs(type(parent))
        seen = involved[".".join(parts[:depth])] <= runs.keys()
        item = _position(child, parts[depth + 1]) if depth + 1 < len(parts) else 0
        key.append(_sibling_key(runs[name] if seen else None, item, _position(parent, name)))
        parent = child
    return tuple(key)


def _position(parent: torch.nn.Module, name: str) -> int:
    """Where ``name`` comes among ``parent``'s children in definition order (after them all if it is none)."""
    children = list(parent._modules)
    return children.index(name) if name in children else len(children)


def _sibling_key(run: Run | None, item: int, definition: int) -> tuple[int, int, int, int]:
    """The sort key of a child among its siblings: (when it or its loop first runs, which item of it the path goes
    on to where a loop runs it item by item, when it first runs, its definition position); ``run`` is None where
    the parent's forward is not read for its siblings (definition order)."""
    if run is None:
        return (0, 0, 0, definition)
    if run.loop is None:
        return (run.step, 0, run.step, definition)
    return (run.loop, item, run.step, definition)


class Run(NamedTuple):
    """When a forward first runs a child of its module."""

    step: int  #: the count, in evaluation order, of children the forward had run before it
    loop: int | None  #: the step of the first child run by the loop that runs this child item by item (None if none)


#: Modules whose children run in index order (or as their holder runs them): their forwards name none.
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


@functools.cache
def _first_runs(module_class: type) -> dict[str, Run]:
    """``{attribute: run}``: when ``module_class.forward`` first runs each ``self.<attribute>`` (calls it, its
    ``forward``, an item of it, an item of it by a loop variable, loops over it or hands it to one of
    ``_RUNNERS``; or hands it to another call, where it does none of these anywhere), and the loop that runs it
    item by item ({} where its source cannot be read). A mere read (``self.text_model.get_input_embeddings()``,
    ``self.decoder.embed_tokens.weight.dtype``) runs nothing and is not counted, nor is a hand-off to another
    call of a child the forward runs itself (BLT hands its local encoder to a helper that reads its embeddings
    before it runs its patcher, then the encoder)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(module_class.forward)))
    except (OSError, TypeError, SyntaxError):
        return {}
    runs = _Runs()
    runs.visit(tree)
    return runs.first()


#: Functions that run the module handed to them (other calls handed a child may only read it, as BLT's
#: ``compute_hash_embeddings(input_ids, self.local_encoder, ...)`` reads the encoder's embeddings).
_RUNNERS = ("checkpoint", "_gradient_checkpointing_func", "apply_chunking_to_forward")

#: Builtins that hand a loop the items of the lists given to them in index order.
_ITEMWISE = ("enumerate", "zip")


class _Runs(ast.NodeVisitor):
    """Walks a forward's syntax in evaluation order, noting each run and hand-off of a ``self.<child>``: a call
    counts after its arguments (``self.late(self.early(x))`` runs ``early`` first)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, bool, int | None]] = []  # (child, surely run?, id of the loop running it)
        self.loops: list[tuple[int, set[str]]] = []  # the enclosing for loops: (id, names their targets bind)
        self.count = 0  # for loops met so far (the next one's id)

    def first(self) -> dict[str, Run]:
        """Each child's first run: its first sure run, or its first hand-off to another call where it has none."""
        direct = {child for child, itself, _ in self.events if itself}
        first: dict[str, tuple[int, int | None]] = {}
        for child, itself, loop in self.events:
            if itself or child not in direct:
                first.setdefault(child, (len(first), loop))
        starts: dict[int, int] = {}  # loop id -> step of the first child it runs item by item
        for step, loop in first.values():
            if loop is not None:
                starts.setdefault(loop, step)
        return {child: Run(step, starts.get(loop)) for child, (step, loop) in first.items()}

    def _ran(self, name: str, itself: bool = True, loop: int | None = None) -> None:
        self.events.append((name, itself, loop))

    def _loop_of(self, node: ast.AST) -> int | None:
        """The id of the innermost enclosing loop whose variable indexes ``node`` (``self.x[i]``), else None."""
        if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name)):
            return None
        return next((loop for loop, names in reversed(self.loops) if node.slice.id in names), None)

    def visit_Call(self, node: ast.Call) -> None:
        for part in (*node.args, *node.keywords):
            self.visit(part)
        runner = _function_name(node.func) in _RUNNERS  # checkpoint(self.layer, x) runs self.layer
        for argument in (*node.args, *(keyword.value for keyword in node.keywords)):
            if _self_child(argument) is not None:
                self._ran(_self_child(argument), itself=runner)
        function = node.func  # self.x(...), self.x[i](...)
        if _self_child(function) is None and isinstance(function, ast.Attribute) and function.attr == "forward":
            function = function.value  # self.x.forward(...)
        if _self_child(function) is not None:
            self._ran(_self_child(function), loop=self._loop_of(function))
        else:
            self.visit(node.func)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        loop = self._loop_of(node)  # layer = self.layers[i]
        if loop is not None and _self_child(node) is not None:
            self._ran(_self_child(node), loop=loop)
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        loop, self.count = self.count, self.count + 1
        for listed in _iterated(node.iter):
            self._ran(listed, loop=loop)
        self.loops.append((loop, {name.id for name in ast.walk(node.target) if isinstance(name, ast.Name)}))
        for statement in (*node.body, *node.orelse):
            self.visit(statement)
        self.loops.pop()


def _function_name(node: ast.AST) -> str | None:
    """The name a call's function goes by: ``f`` of ``f(...)``, ``self.f(...)`` or ``torch.utils.checkpoint.f(...)``
    (None for another expression)."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _iterated(node: ast.AST) -> list[str]:
    """The children a loop over ``node`` takes item by item: ``layers`` of ``self.layers``,
    ``enumerate(self.layers)`` or ``zip(self.layers, ...)``."""
    parts = [node]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ITEMWISE:
        parts = node.args
    return [child for child in map(_self_child, parts) if child is not None]


def _self_child(node: ast.AST) -> str | None:
    """``x`` of ``self.x`` or ``self.x[...]``, else None."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None
