"""The package's dependencies point one way (docs/dev/core-api.md): ``families`` describe, ``components`` serve, everything else
reads components, and ``export``, ``compress``, ``parallel``, ``analysis`` never import each other.

Ground truth: every import statement in ``src/moelens`` (module level or inside a function), parsed with ``ast``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import moelens

PACKAGE = Path(moelens.__file__).parent
FEATURES = ("export", "compress", "parallel", "analysis")


def imported_parts(path: Path, package: Path = PACKAGE) -> set[str]:
    """The top-level parts of moelens (``analysis``, ``model``, ...) that the module at ``path`` (in the moelens
    source tree ``package``) imports anywhere."""
    here = path.relative_to(package.parent).with_suffix("").parts  # ("moelens", "export", "exporter")
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the module's package
                base = here[: len(here) - node.level]
                target = (*base, *(node.module.split(".") if node.module else ()))
                names = [(*target, alias.name) for alias in node.names] if not node.module else [target]
            else:
                names = [tuple(node.module.split("."))] if node.module else []
        elif isinstance(node, ast.Import):
            names = [tuple(alias.name.split(".")) for alias in node.names]
        else:
            continue
        parts |= {name[1] for name in names if len(name) > 1 and name[0] == "moelens"}
    return parts


def modules_of(part: str) -> list[Path]:
    return sorted((PACKAGE / part).rglob("*.py"))


@pytest.mark.parametrize("feature", FEATURES)
def test_the_feature_packages_never_import_each_other(feature):
    """export/exporter.py read the vocabulary size from analysis.corpus (an export loaded 15 analysis modules), and
    families/check.py and components/params.py imported analysis and parallel helpers."""
    crossing = {str(path.relative_to(PACKAGE)): sorted(imported_parts(path) & (set(FEATURES) - {feature}))
                for path in modules_of(feature)}
    assert not {name: parts for name, parts in crossing.items() if parts}


@pytest.mark.parametrize("layer", ["families", "components"])
def test_families_and_components_import_no_feature(layer):
    crossing = {str(path.relative_to(PACKAGE)): sorted(imported_parts(path) & set(FEATURES)) for path in modules_of(layer)}
    assert not {name: parts for name, parts in crossing.items() if parts}


def test_the_families_describe_and_only_check_runs_a_model():
    """A family entry is data: only `families.check`, which runs a wrapped model to test an entry, reads components."""
    readers = {str(path.relative_to(PACKAGE)) for path in modules_of("families")
               if imported_parts(path) & {"components", "model", "wrapping", "interventions", "loading"}}
    assert readers == {"families/check.py"}


def test_the_scan_sees_imports_of_every_form(tmp_path):
    """The scan itself: relative and absolute imports, at module level and in a function."""
    module = tmp_path / "moelens" / "export" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text("from ..analysis import corpus\nimport moelens.parallel.shard\ndef f():\n"
                      "    from .. import model\n    from moelens.compress import tomoe\n")
    assert imported_parts(module, tmp_path / "moelens") == {"analysis", "parallel", "model", "compress"}


def unresolved_imports(package: Path = PACKAGE) -> list[str]:
    """Every ``from ... import`` of moelens in the source tree (module level or inside a function, relative or
    absolute) whose module or name does not exist, as ``file:line module.name``; imports of optional dependencies
    that fail otherwise are skipped. A function-local import runs only when its function does: a module moved to
    another package leaves its relative imports pointing nowhere, and only the call that needs one finds out."""
    import importlib
    import importlib.util

    unresolved = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        here = parts[:-1] if parts[-1] == "__init__" else parts
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith("moelens")):
                continue
            base = here[: len(here) - node.level + (parts[-1] == "__init__")] if node.level else ()
            module = ".".join((*base, *(node.module.split(".") if node.module else ()))) if node.level else node.module
            where = f"{path.relative_to(package.parent)}:{node.lineno} {module}"
            try:
                imported = importlib.import_module(module)
            except ModuleNotFoundError as error:
                if (error.name or "").startswith("moelens"):
                    unresolved.append(where)
                continue
            except ImportError:  # an optional dependency of that module
                continue
            unresolved += [f"{where}.{alias.name}" for alias in node.names if alias.name != "*"
                           and not hasattr(imported, alias.name)
                           and importlib.util.find_spec(f"{module}.{alias.name}") is None]
    return unresolved


def test_every_import_of_moelens_resolves():
    assert unresolved_imports() == []
