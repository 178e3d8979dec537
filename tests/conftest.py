"""Test settings shared by every test module.

Torch runs one thread per test process: the suite runs in parallel processes
(pytest -n 2) on small machines, where more threads per process only contend.
Nothing here downloads anything: the hub is switched off.

``MOELENS_TEST_DEVICE=cuda`` moves every tiny model the tests build onto that device (the
tests then run the models there; tiny_inputs follows the model). CI does not set it: it is
for a hand run on a machine with an accelerator (docs/dev/devices.md).
"""

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True, scope="session")
def _command_modules_imported() -> None:
    """Import the CLI's command bodies before any test: one imported first while a test has monkeypatched
    ``moelens.analysis.cli.load_model`` (the stats flag checks) would keep the patch as its own ``load_model``, and
    a later test's ``moelens generate`` fail with it (a command imports its body when it first runs)."""
    import moelens.analysis.generate_command  # noqa: F401 (imports moelens.analysis.cli too)
    import moelens.export.cli  # noqa: F401


def _build_tiny_models_on(device: str) -> None:
    """Make moelens.testing's tiny_model return its model moved to ``device`` (before any test
    module imports it)."""
    import functools

    import moelens.testing
    import moelens.testing.tiny

    build = moelens.testing.tiny.tiny_model

    @functools.wraps(build)
    def tiny_model_on_device(*args, **kwargs):
        return build(*args, **kwargs).to(device)

    moelens.testing.tiny_model = moelens.testing.tiny.tiny_model = tiny_model_on_device


if os.environ.get("MOELENS_TEST_DEVICE"):
    _build_tiny_models_on(os.environ["MOELENS_TEST_DEVICE"])


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder this process may not write into: chmod 555, or for root (whom modes do not stop) chattr +i. It holds
    one empty folder, ``writable``, that may be written into."""
    folder = tmp_path / "read-only"
    (folder / "writable").mkdir(parents=True)
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
            pytest.skip("running as root on a filesystem without chattr +i: no folder root may not write into")
        restore = ["chattr", "-i", str(folder)]
    else:
        folder.chmod(0o555)
        restore = ["chmod", "755", str(folder)]
    yield folder
    subprocess.run(restore, check=True)
