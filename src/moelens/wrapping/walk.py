"""The module paths each trace checks for a compilation since wrapping, and a fast walk to them (`moelens.model`)."""

from __future__ import annotations

from typing import Iterator

import torch

from ..discovery import paths_above


def _around_blocks(model: torch.nn.Module, blocks: list[str]) -> list[str]:
    """The paths of the model, every module on the way down to its MoE blocks, the blocks and their children
    (router, experts, shared expert): where a compilation made after wrapping would reach the forwards moelens reads."""
    above = paths_above(blocks)
    inside = [f"{block}.{name}".rstrip(".") for block in blocks
              for name in ["", *(child for child, _ in model.get_submodule(block).named_children())]]
    return sorted(above) + inside


def _walk_steps(paths: list[str]) -> tuple[tuple[str, int, str], ...]:
    """How `_present` walks ``paths`` (each one's parent among them, ``""`` the model): ``(path, the position of its
    parent's step, -1 for the model itself, its own name)``, each parent before its children."""
    ordered = sorted(set(paths))  # a path sorts before the paths that extend it
    position = {path: index for index, path in enumerate(ordered)}
    return tuple((path, position[path.rpartition(".")[0]] if path else -1, path.rpartition(".")[2]) for path in ordered)


def _present(model: torch.nn.Module, steps: tuple[tuple[str, int, str], ...]) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(path, module)`` for each path of ``steps`` (`_walk_steps`) that still names a module of ``model`` (one may
    have been swapped). Walked through the registered children, each module once: run before every trace, where
    ``get_submodule`` costs 0.2 ms."""
    found: list[torch.nn.Module | None] = []
    for path, parent, name in steps:
        holder = found[parent] if parent >= 0 else None
        module = model if parent < 0 else holder._modules.get(name) if holder is not None else None
        found.append(module)
        if module is not None:
            yield path, module
