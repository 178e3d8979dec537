#!/usr/bin/env bash
# The test suite with every tiny model on a CUDA device, then the trace-overhead bench there.
# Run by hand on a machine with a GPU (CI has none), from the repository root, with moelens
# importable: bash bench/cuda_suite.sh OUTPUT_FOLDER [WORKERS]
# Writes OUTPUT_FOLDER/suite.log, OUTPUT_FOLDER/junit.xml and OUTPUT_FOLDER/bench.log; the
# notebook tests are left out (they start a Jupyter kernel, which is no device check).
set -u
out=${1:?give an output folder}; workers=${2:-8}
mkdir -p "$out"
export MOELENS_TEST_DEVICE=cuda PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers, nnsight, moelens; print("torch", torch.__version__, "transformers", transformers.__version__, "nnsight", nnsight.__version__, torch.cuda.get_device_name())' || exit 1
timeout "${SUITE_SECONDS:-270}" python3 -m pytest -q -n "$workers" -p no:cacheprovider --timeout 120 \
    --ignore=tests/test_notebooks.py --junitxml="$out/junit.xml" tests > "$out/suite.log" 2>&1
echo "suite exit $?"; tail -n 3 "$out/suite.log"
(cd bench && timeout "${BENCH_SECONDS:-100}" python3 trace_overhead.py --repeats 15 --device cuda) > "$out/bench.log" 2>&1
echo "bench exit $?"; cat "$out/bench.log"
