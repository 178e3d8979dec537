"""to_nnef's verification refuses an archive whose tract output is off.

Ground truth: tract's real output on the archive, perturbed on the way back from tract
(``moelens.export.verification.run`` wrapped) by an amount chosen against tract's
"approximate" tolerance (``|a - b| <= 1e-4 + 5e-4 |b|``): far beyond it the export
must fail, well within it the export must pass. Needs the ``export`` extra.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("torch_to_nnef", reason="the export extra is not installed (pip install 'moelens[export]')")
pytest.importorskip("tract", reason="the export extra is not installed (pip install 'moelens[export]')")

import moelens  # noqa: E402
from moelens.export import ExportError, to_nnef  # noqa: E402
from moelens.export import verification  # noqa: E402
from moelens.testing import TINY_OVERRIDES, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def block():
    """A tiny mixtral's first MoE block (expert size 32, so Q4_0 takes it)."""
    extra = {"num_hidden_layers": 2, "intermediate_size": 32}
    for key, value in TINY_OVERRIDES["mixtral"].items():
        if isinstance(value, list) and len(value) == 4 and key != "moe_layers":
            extra[key] = value[:2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return moelens.wrap(tiny_model("mixtral", **extra)).moes[0]


def perturb_tract(monkeypatch, shift: float) -> list[np.ndarray]:
    """Make tract's output (as to_nnef's check reads it) off by ``shift`` at its first element; returns
    what tract really gave, call by call."""
    real = verification.run
    seen = []

    def shifted(path, inputs):
        output = np.array(real(path, inputs), copy=True)
        seen.append(output.copy())
        output.flat[0] += shift
        return output

    monkeypatch.setattr(verification, "run", shifted)
    return seen


@pytest.mark.parametrize("quantize", [None, "q4_0"], ids=["float32", "q4_0"])
def test_export_fails_when_tract_differs_from_torch(block, quantize, tmp_path, monkeypatch):
    """tract off by 0.05 (far beyond 'approximate') fails the export, naming the mismatch; the archive is kept.

    Guards against the float32 check, or the Q4_0 check against the export's own dequantized
    weights, passing whatever tract outputs.
    """
    seen = perturb_tract(monkeypatch, 0.05)
    path = tmp_path / "off.nnef.tgz"
    with pytest.raises(ExportError, match="tract's output differs from torch") as caught:
        to_nnef(block, path, quantize_experts=quantize)
    assert seen, "tract was not run"
    assert "The archive was written" in str(caught.value)
    assert ("Q4_0" in str(caught.value)) == (quantize == "q4_0")
    assert path.exists()


@pytest.mark.parametrize("quantize", [None, "q4_0"], ids=["float32", "q4_0"])
def test_export_passes_when_tract_is_within_tolerance(block, quantize, tmp_path, monkeypatch):
    """tract off by 1e-6 (well within 'approximate') still passes: the failure above is the check, not noise."""
    seen = perturb_tract(monkeypatch, 1e-6)
    report = to_nnef(block, tmp_path / "close.nnef.tgz", quantize_experts=quantize)
    assert seen and report.verification is not None
