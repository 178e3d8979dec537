"""Test settings shared by every test module.

Torch runs one thread per test process: the suite runs in parallel processes
(pytest -n 2) on small machines, where more threads per process only contend.
Nothing here downloads anything: the hub is switched off.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
