"""Run an NNEF archive in tract (the ``tract`` Python package) and compare with tract's tolerances."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..paths import user_path
from .errors import ExportError, TractRunFailed
from .tract_cli import TOLERANCES, load_runnable, meets

#: The oldest tract with tract_moe_ffn.
MIN_TRACT_VERSION = "0.23.9"

__all__ = ["MIN_TRACT_VERSION", "TOLERANCES", "Loaded", "load", "meets", "output_scale", "tolerance_met",
           "tract_module"]


def tract_module() -> Any:
    """The ``tract`` package, checked to be recent enough for tract_moe_ffn."""
    try:
        import tract
    except ImportError as error:
        raise ExportError(
            "running NNEF archives needs the tract Python package: pip install 'moelens[export]'."
        ) from error
    version = tract.version()
    if _version(version) < _version(MIN_TRACT_VERSION):
        raise ExportError(f"tract {version} has no tract_moe_ffn; install tract>={MIN_TRACT_VERSION}.")
    return tract


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


def output_scale(expected: np.ndarray) -> float:
    """The size of an output: its largest finite magnitude (1.0 where it has none above 0)."""
    finite = np.abs(np.asarray(expected, dtype=np.float64))
    finite = finite[np.isfinite(finite)]
    largest = float(finite.max()) if finite.size else 0.0
    return largest if largest > 0 else 1.0


def tolerance_met(actual: np.ndarray, expected: np.ndarray, scale: float = 1.0) -> str | None:
    """The tightest of tract's levels that ``actual`` meets against ``expected``, both divided by ``scale``
    (None: not even ``ultra``). Divided by the output's size (`output_scale`), a level's absolute part
    (``atol`` in ``|a - b| <= atol + rtol |b|``) counts relative to it: tract's own rule, on the raw
    values, lets a whole output below ``atol`` through and fails the float32 rounding of a large one.

    An infinity in ``expected`` must be the same infinity in ``actual``: tract's own rule (`meets`)
    lets any finite value pass against an infinite ``b`` from ``close`` up.
    """
    a, b = np.asarray(actual, dtype=np.float32), np.asarray(expected, dtype=np.float32)
    if a.shape == b.shape and (np.isinf(b) & (a != b)).any():
        return None
    if scale != 1.0:
        a, b = a / np.float32(scale), b / np.float32(scale)
    return next((level for level in TOLERANCES if meets(a, b, level)), None)


@dataclass
class Loaded:
    """An archive loaded into tract: the runnable, its input names and properties."""

    runnable: Any
    input_names: list[str]
    properties: dict[str, str]

    def run(self, inputs: Sequence[np.ndarray] | Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Outputs for ``inputs`` (in input order, or by input name)."""
        if isinstance(inputs, Mapping):
            missing = [name for name in self.input_names if name not in inputs]
            if missing:
                raise ExportError(f"the archive's inputs are {self.input_names}; missing {missing}.")
            inputs = [inputs[name] for name in self.input_names]
        values = [np.ascontiguousarray(value) for value in inputs]
        return [output.to_numpy() for output in self.runnable.run(values)]


def run_isolated(path: str | Path, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The archive's outputs for ``inputs``, computed by tract in a separate process.

    A malformed graph can make tract abort the process it runs in (a Rust panic); run
    in a child process, it becomes an `ExportError` instead of ending the caller's session.
    """
    import subprocess
    import tempfile

    from .tract_cli import standin_path

    tract_module()
    path = user_path(path, error=ExportError)
    if not path.exists():
        raise ExportError(f"no NNEF archive at {path}.")
    with tempfile.TemporaryDirectory(prefix="moelens-run-") as folder:
        bundle, saved = Path(folder) / "inputs.npz", Path(folder) / "outputs.npz"
        np.savez(bundle, **{f"input_{i}": np.ascontiguousarray(a) for i, a in enumerate(inputs)})
        done = subprocess.run(
            [str(standin_path()), str(path.absolute()), "run", "--input-from-bundle", str(bundle), "--save-outputs-npz", str(saved)],
            capture_output=True, text=True,
        )
        if done.returncode != 0 or not saved.exists():
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            detail = next((line for line in lines if "panicked" in line or "ERROR" in line), lines[-1] if lines else "")
            raise TractRunFailed(f"tract could not load or run {path} (exit status {done.returncode}): {detail.strip()}",
                                 detail.strip())
        with np.load(saved) as outputs:
            return [outputs[f"output_{i}"] for i in range(len(outputs.files))]


def load(path: str | Path) -> Loaded:
    """Load an NNEF archive (``.nnef.tgz``, ``.nnef.tar`` or a folder) into tract with its transformers ops."""
    tract_module()
    path = user_path(path, error=ExportError)
    if not path.exists():
        raise ExportError(f"no NNEF archive at {path}.")
    runnable, names = load_runnable(path)
    return Loaded(runnable, names, properties(path))


def properties(path: str | Path) -> dict[str, str]:
    """The archive's ``tract_core_properties`` (versions, moelens' settings), read from its graph.nnef."""
    from .archive import graph_text

    text = graph_text(path)
    return dict(re.findall(r'\("([^"]*)", "([^"]*)"\)', text))
