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
               if imported_parts(path) & {"components", "model", "interventions", "loading"}}
    assert readers == {"families/check.py"}


def test_the_scan_sees_imports_of_every_form(tmp_path):
    """The scan itself: relative and absolute imports, at module level and in a function."""
    module = tmp_path / "moelens" / "export" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text("from ..analysis import corpus\nimport moelens.parallel.shard\ndef f():\n"
                      "    from .. import model\n    from moelens.compress import tomoe\n")
    assert imported_parts(module, tmp_path / "moelens") == {"analysis", "parallel", "model", "compress"}
