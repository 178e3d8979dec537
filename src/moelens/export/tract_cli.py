"""A stand-in for the ``tract`` command line, backed by the ``tract`` Python package.

torch-to-nnef wants a tract *binary*: it runs ``tract --version`` when a target is
built and ``tract MODEL ... run --input-from-bundle IN.npz --assert-output-bundle
OUT.npz --approx LEVEL`` to check an export, and downloads one from GitHub when none
is given. moelens never downloads: `standin_path` writes a tiny executable that runs
this file with the current Python, and answers those two commands (plus
``--save-outputs-npz``) through the installed tract package. Failures are printed on
stderr with ``ERROR``, which is how torch-to-nnef recognises them.

The file imports nothing from moelens (torch-to-nnef calls it as a subprocess, and
importing moelens would cost seconds per call); `moelens.export.runner` takes its
tolerance rules from here. Run directly, as torch-to-nnef runs it, by its path:
``python "$(python -c 'import moelens.export.tract_cli as t; print(t.__file__)')" --version``
(``python -m`` works too, with a RuntimeWarning: ``moelens.export`` imports this module first).
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

_STANDIN: Path | None = None

#: tract's comparison levels (``Approximation`` in tract-data): name -> (atol, rtol, outlier fraction).
#: An output meets a level when ``|a - b| <= atol + rtol * |b|`` for all but that fraction of its values.
TOLERANCES: dict = {
    "exact": (0.0, 0.0, 0.0),
    "close": (1e-7, 1e-7, 0.0),
    "approximate": (1e-4, 5e-4, 0.0),
    "very": (5e-2, 1e-2, 0.0),
    "super": (0.1, 0.05, 1e-4),
    "ultra": (0.2, 0.1, 5e-4),
}


def meets(actual, expected, level: str) -> bool:
    """Whether ``actual`` matches ``expected`` at tract's tolerance ``level`` (as ``Tensor::close_enough``)."""
    atol, rtol, outliers = TOLERANCES[level]
    a = np.asarray(actual, dtype=np.float32)
    b = np.asarray(expected, dtype=np.float32)
    if a.shape != b.shape:
        return False
    ok = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b)))
    with np.errstate(invalid="ignore"):
        ok |= np.abs(a - b) <= atol + rtol * np.abs(b)
    return a.size == 0 or (1.0 - ok.mean()) <= outliers


def load_runnable(path: str | Path) -> tuple[Any, list[str]]:
    """An archive loaded into tract with its transformers ops: the runnable and its input names."""
    import tract

    model = tract.nnef().with_tract_transformers().with_tract_extra().load(str(path))
    names = [model.input_name(index) for index in range(model.input_count())]
    return model.into_runnable(), names


def standin_path() -> Path:
    """An executable ``tract`` stand-in for this Python (created once per process, removed at exit)."""
    global _STANDIN
    if _STANDIN is None or not _STANDIN.exists():
        folder = Path(tempfile.mkdtemp(prefix="moelens-tract-"))
        atexit.register(shutil.rmtree, folder, True)
        script = folder / "tract"
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I "{Path(__file__).resolve()}" "$@"\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        _STANDIN = script
    return _STANDIN


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else None


def one_line(error: BaseException) -> str:
    """tract's error with its chain of causes on one line, without the stack backtrace it appends
    ("opening file x; Caused by: 0: running pass PropConst(99); 1: ...")."""
    text = str(error).split("Stack backtrace")[0]
    return "; ".join(line.strip() for line in text.splitlines() if line.strip()).replace("Caused by:; ", "caused by: ")


def main(argv: list[str] | None = None) -> int:
    """Answer the tract command lines torch-to-nnef issues; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--version" in argv or "-V" in argv:
        try:
            import tract
        except ImportError:
            print("ERROR moelens tract stand-in needs the tract Python package: pip install 'moelens[export]'",
                  file=sys.stderr)
            return 2
        print(f"tract {tract.version()}")
        return 0
    if "run" not in argv or not argv or argv[0].startswith("-"):
        print("ERROR moelens tract stand-in: only `--version` and `MODEL ... run --input-from-bundle ...` "
              f"are supported, got {argv}", file=sys.stderr)
        return 2
    try:
        runnable, names = load_runnable(argv[0])
        bundle = np.load(_option(argv, "--input-from-bundle"))
        arrays = [bundle[name] if name in bundle.files else bundle[bundle.files[i]] for i, name in enumerate(names)]
        outputs = [o.to_numpy() for o in runnable.run([np.ascontiguousarray(a) for a in arrays])]
    except Exception as error:  # noqa: BLE001 - reported to torch-to-nnef on stderr
        print(f"ERROR moelens tract stand-in could not run {argv[0]}: {one_line(error)}", file=sys.stderr)
        return 1
    save = _option(argv, "--save-outputs-npz")
    if save:
        np.savez(save, **{f"output_{i}": value for i, value in enumerate(outputs)})
    expected_path = _option(argv, "--assert-output-bundle")
    if expected_path:
        level = _option(argv, "--approx") or "close"
        if level not in TOLERANCES:
            print(f"ERROR unknown --approx level {level!r}; tract knows {list(TOLERANCES)}", file=sys.stderr)
            return 2
        expected = np.load(expected_path)
        for index, name in enumerate(expected.files):
            if index >= len(outputs):
                print(f"ERROR output {name}: the model has only {len(outputs)} outputs", file=sys.stderr)
                return 1
            if not meets(outputs[index], expected[name], level):
                error = np.abs(outputs[index].astype(np.float64) - expected[name]).max()
                print(f"ERROR output {name}: max abs err {error:.4g} exceeds tract's {level!r} tolerance",
                      file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
