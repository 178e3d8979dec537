"""The hand-run benchmarks refuse bad arguments as the command line is read (they are not run here otherwise).

Before: ``routing_stats.py --memory-windows 0`` started the whole benchmark again inside its memory step, nested;
``--threads 0`` failed in torch, ``ep_comm.py --worlds 1`` in a division after all its runs, and ``--json`` into a
missing folder only after the run, losing its numbers. Ground truth: each script run as a user runs it.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from arguments import at_least, output_file  # noqa: E402


def test_at_least_takes_integers_from_the_minimum():
    assert at_least(2)("2") == 2 and at_least(1)("40") == 40
    for text in ("1", "0", "-3", "2.5", "two", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"must be an integer of at least 2, got {text!r}"):
            at_least(2)(text)


def test_output_file_wants_a_file_in_a_folder_that_exists(tmp_path):
    assert output_file(str(tmp_path / "numbers.json")) == tmp_path / "numbers.json"
    with pytest.raises(argparse.ArgumentTypeError, match=r"its folder '.*missing' does not exist; create it first"):
        output_file(str(tmp_path / "missing" / "numbers.json"))
    with pytest.raises(argparse.ArgumentTypeError, match=r"is a folder; give a file name in it"):
        output_file(str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # nothing created


@pytest.mark.parametrize(("script", "arguments", "said"), [
    ("routing_stats.py", ["--memory-windows", "0"], r"--memory-windows: must be an integer of at least 1, got '0'"),
    ("trace_overhead.py", ["--threads", "0"], r"--threads: must be an integer of at least 1, got '0'"),
    ("ep_comm.py", ["--worlds", "2", "1"], r"--worlds: must be an integer of at least 2, got '1'"),
    # --family: refused before any rank starts (each rank died with a traceback), naming the option
    ("ep_comm.py", ["--family", "mixtrl"], r"--family: 'mixtrl' is no family .*did you mean 'mixtral'"),
    ("ep_comm.py", ["--family", "dbrx"], r"--family dbrx: moelens cannot shard its experts"),
    ("ep_comm.py", ["--family", "qwen3_moe", "--layers", "1"],
     r"--layers 1: the tiny qwen3_moe model has no MoE layer"),
    ("ep_comm.py", ["--family", "beam", "--layers", "2"], r"--layers: the tiny beam config does not take "
                                                          r"num_hidden_layers=2 .*mlp_layer_types"),
    ("ep_comm.py", ["--experts", "6", "--worlds", "2", "4"], r"--experts 6 / --worlds 4: .*not a multiple of the 4"),
    ("export_tract.py", ["--json", "no-such-folder/out.json"], r"--json: 'no-such-folder/out.json': its folder"),
    ("compress_quality.py", ["--skip-minilm", "--skip-tiny"], r"leave nothing to measure"),
])
def test_each_benchmark_refuses_a_bad_argument_before_it_runs(script, arguments, said, tmp_path, monkeypatch, capsys):
    """Each script runs as ``python bench/<script> ...`` runs it, from an empty working folder, but in this process
    (``runpy``: a process of its own imports torch again, seconds a case); the settings a script makes as it starts
    (environment, torch's threads) are put back."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), *arguments])
    monkeypatch.setattr(os, "environ", os.environ.copy())
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(str(BENCH / script), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    done = capsys.readouterr()
    assert exited.value.code == 2, (done.out[-2000:], done.err[-2000:])  # argparse's usage error
    assert re.search(said, done.err), done.err[-2000:]
    assert done.out == "" and list(tmp_path.iterdir()) == []


def test_a_benchmark_refuses_a_bad_argument_in_a_process_of_its_own(tmp_path):
    """The same refusal from a real command line (exit status 2, argparse's usage on stderr)."""
    done = subprocess.run([sys.executable, str(BENCH / "routing_stats.py"), "--memory-windows", "0"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-2000:])
    assert re.search(r"--memory-windows: must be an integer of at least 1, got '0'", done.stderr), done.stderr[-2000:]
    assert done.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("family", "moe_layers"), [("mixtral", 3), ("qwen3_moe", 2), ("deepseek_v3", 2)])
def test_ep_comm_builds_its_sizes_into_every_family_s_tiny_model(family, moe_layers):
    """``ep_comm.py --family``: the options reach the family's config under its own names (qwen3_moe's config has no
    num_local_experts; deepseek_v3's experts are sized by moe_intermediate_size); layer 0 of the last two is dense."""
    import importlib

    import moelens

    ep_comm = importlib.import_module("ep_comm")
    args = argparse.Namespace(family=family, hidden=32, intermediate=64, experts=4, layers=3)
    model = ep_comm._model(args)
    moes = moelens.wrap(model).moes
    assert len(model.model.layers) == 3 and len(moes) == moe_layers
    assert {tuple(moe.params().down.shape) for moe in moes} == {(4, 32, 64)}  # [E, D, I]
