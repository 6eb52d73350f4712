#!/bin/bash
# The GPU-marked tests (`pytest -m gpu`) in PARTS slices of the test files, so each fits one
# device call (the device runs a command for at most 600 s). Slice i of n takes every n-th file
# of the sorted list of files that hold GPU tests, starting at i (1-based).
#
#   PART=1 PARTS=3 bash tools/gpu_tests.sh     # then PART=2, PART=3 (PYTHON: the interpreter)
set -u
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
PART=${PART:-1} PARTS=${PARTS:-1}
mapfile -t files < <(grep -l "mark.gpu" tests/test_*.py | sort | awk -v p="$PART" -v n="$PARTS" 'NR % n == p % n')
echo "part $PART of $PARTS: ${files[*]}"
timeout "${TIMEOUT:-560}" "${PYTHON:-python3}" -m pytest -q -m gpu -p no:cacheprovider "${files[@]}" 2>&1 | tail -"${TAIL:-15}"
