#!/usr/bin/env bash
# The test suite with every tiny model on a CUDA device, then the trace-overhead bench there.
# Run by hand on a machine with a GPU (CI has none), from the repository root, with moelens
# importable: bash bench/cuda_suite.sh OUTPUT_FOLDER [WORKERS]
# Writes OUTPUT_FOLDER/suite.log, OUTPUT_FOLDER/junit.xml and OUTPUT_FOLDER/bench.log; the
# notebook tests are left out (they start a Jupyter kernel, which is no device check).
set -u
case "${1:-}" in -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
out=${1:?give an output folder}; workers=${2:-8}
mkdir -p "$out"
export MOELENS_TEST_DEVICE=cuda PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers, nnsight, moelens; print("torch", torch.__version__, "transformers", transformers.__version__, "nnsight", nnsight.__version__, torch.cuda.get_device_name())' || exit 1
per_test=(); if python3 -c 'import pytest_timeout' 2>/dev/null; then per_test=(--timeout 120)
else echo "pytest-timeout is not installed (not in .[dev]): no per-test timeout"; fi
timeout "${SUITE_SECONDS:-270}" python3 -m pytest -q -n "$workers" -p no:cacheprovider "${per_test[@]}" \
    --ignore=tests/test_notebooks.py --junitxml="$out/junit.xml" tests > "$out/suite.log" 2>&1
code=$?; echo "suite exit $code"; [ "$code" = 124 ] && echo "cut at SUITE_SECONDS: no junit.xml, no summary"
tail -n 3 "$out/suite.log"
(cd bench && timeout "${BENCH_SECONDS:-100}" python3 trace_overhead.py --repeats 15 --device cuda) > "$out/bench.log" 2>&1
echo "bench exit $?"; cat "$out/bench.log"
