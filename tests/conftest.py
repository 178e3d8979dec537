"""Test settings shared by every test module.

Torch runs one thread per test process: the suite runs in parallel processes
(pytest -n 2) on small machines, where more threads per process only contend.
Nothing here downloads anything: the hub is switched off.
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


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder this process may not write into: chmod 555, or for root (whom modes do not stop) chattr +i."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
            pytest.skip("running as root on a filesystem without chattr +i: no folder root may not write into")
        restore = ["chattr", "-i", str(folder)]
    else:
        folder.chmod(0o555)
        restore = ["chmod", "755", str(folder)]
    yield folder
    subprocess.run(restore, check=True)
