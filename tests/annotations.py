"""Checking values against their jaxtyping annotations, the documented shapes, with one size per axis name.

moelens does not check its annotations at run time; these tests do, so that an annotation that names the wrong
shape (and would fail a user's ``jaxtyping.install_import_hook``) fails here.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import jaxtyping

Check = tuple[str, Any, Any]  # (what the value is, the value, its annotation)


def assert_annotations_hold(checks: list[Check]) -> None:
    """Assert each ``(name, value, annotation)``: ``list[X]`` and ``tuple[X, Y]`` annotations element by element,
    others (jaxtyping types, ``X | None``) by isinstance; an axis name has one size across all of them."""
    _assert_each(_leaves(checks))


def _leaves(checks: list[Check]) -> list[Check]:
    """The checks with ``list[X]`` and ``tuple[X, Y]`` annotations split into one check per element."""
    leaves = []
    for name, value, annotation in checks:
        origin, parts = typing.get_origin(annotation), typing.get_args(annotation)
        if origin is list:
            leaves += _leaves([(f"{name}[{i}]", item, parts[0]) for i, item in enumerate(value)])
        elif origin is tuple:
            assert len(value) == len(parts), (name, len(value), annotation)
            leaves += _leaves([(f"{name}[{i}]", item, part) for i, (item, part) in enumerate(zip(value, parts))])
        else:
            leaves.append((name, value, annotation))
    return leaves


@jaxtyping.jaxtyped(typechecker=None)  # one axis-size memo for every isinstance check of the call
def _assert_each(leaves: list[Check]) -> None:
    for name, value, annotation in leaves:
        shape = getattr(value, "shape", None)
        assert isinstance(value, annotation), (name, shape and tuple(shape), getattr(value, "dtype", None), annotation)


def annotated_stub(component: type, name: str) -> Any:
    """The function carrying the value ``name``'s annotation: a served value's stub (nnsight's eproperty keeps it as
    its preprocess) or a property's getter."""
    descriptor = inspect.getattr_static(component, name)
    return getattr(descriptor, "_preprocess", None) or descriptor.fget
