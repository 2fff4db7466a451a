#!/usr/bin/env bash
# The GPU check of issue 12, in one command, in under 8 minutes on a machine with an NVIDIA GPU:
#   scripts/gpu_check.sh
# 1. finds a GPU (nvidia-smi); without one it prints "no CUDA device" and exits 0, installing nothing;
# 2. uses $PDSERVE_PYTHON, else the repo's .venv (created by `make install` when missing), and
#    installs Triton into it when torch's own dependency did not bring it;
# 3. builds `builtin:small` into $PDSERVE_CACHE (default: the repo's .cache/, as the tests use)
#    when missing, outside the tests' time budget;
# 4. runs `pytest -m gpu` on tests/gpu/ (cheapest first: kernels, engine, 1P1D, NCCL) with
#    compiled (not interpreted) Triton kernels, then benchmarks/gpu_check.py, and prints one
#    table of both. PYTEST_ADDOPTS reaches pytest (e.g. --timeout=120 where pytest-timeout is).
# GPU_CHECK_SAVE=DIR: keep the full pytest log, its JUnit XML and the benchmark's output and
# errors in DIR (pytest.log, gpu.xml, bench.txt, bench.err).
# Exit status: 0 all passed (or no GPU); 2 a GPU is present but the Python's torch cannot use
# it (a CPU build: the message says what to install); otherwise pytest's or the benchmark's.
#
# Ran on an NVIDIA H200 on 2026-12-04 with PDSERVE_PYTHON set (docs/benchmarks.md, "The GPU
# check"); the `make install` and Triton-install branches have not run on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."

TEST_BUDGET_S=${GPU_CHECK_TEST_S:-300}   # tests/gpu/ as a whole
BENCH_BUDGET_S=${GPU_CHECK_BENCH_S:-150} # benchmarks/gpu_check.py

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "gpu_check: no CUDA device on this machine (nvidia-smi finds no GPU); nothing to check."
    exit 0
fi
nvidia-smi -L

if [[ -n "${PDSERVE_PYTHON:-}" ]]; then
    PY=$PDSERVE_PYTHON
else
    [[ -x .venv/bin/python ]] || make install
    PY=.venv/bin/python
fi

if ! "$PY" - <<'PYEOF'
import sys
import torch
if not torch.cuda.is_available():
    print(f"gpu_check: a GPU is present but torch {torch.__version__} cannot use it (CUDA build: "
          f"{torch.version.cuda}). Install the CUDA build of the pinned torch into this Python, e.g.\n"
          f"  {sys.executable} -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128")
    sys.exit(2)
PYEOF
then
    exit 2
fi
"$PY" -c "import triton" 2>/dev/null || "$PY" -m pip install --quiet "triton>=3.2"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LOGS=${GPU_CHECK_SAVE:-$WORK}  # written as they go: a run stopped from outside still leaves them
mkdir -p "$LOGS"
export TRITON_INTERPRET=0 GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
export PDSERVE_CACHE=${PDSERVE_CACHE:-$PWD/.cache} HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error

# The tests and the benchmark share one built model; building it is not theirs to time.
start=$SECONDS
"$PY" -c 'from engine.model.builtin import ensure_builtin; ensure_builtin("small")'
echo "gpu_check: builtin:small ready in $PDSERVE_CACHE ($((SECONDS - start)) s)"

set +e
timeout "$TEST_BUDGET_S" "$PY" -m pytest -q -rs -m gpu --junitxml="$LOGS/gpu.xml" \
    tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_disaggregated.py \
    tests/gpu/test_gpu_nccl.py >"$LOGS/pytest.log" 2>&1
TEST_RC=$?
tail -n 60 "$LOGS/pytest.log"
timeout "$BENCH_BUDGET_S" "$PY" benchmarks/gpu_check.py >"$LOGS/bench.txt" 2>"$LOGS/bench.err"
BENCH_RC=$?
set -e

echo
echo "==================== gpu_check $(date -u '+%Y-%m-%d %H:%M UTC') ===================="
"$PY" - "$LOGS/gpu.xml" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET
try:
    cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    print("tests/gpu: no report (pytest timed out or did not start)")
    sys.exit(0)
rows = []
for case in cases:
    outcome = "passed"
    for tag in ("failure", "error", "skipped"):
        found = case.find(tag)
        if found is not None:
            outcome = tag + (": " + (found.get("message") or "")[:70] if tag == "skipped" else "")
    rows.append((case.get("name", "?"), f"{float(case.get('time', 0)):.1f} s", outcome))
width = max([len(r[0]) for r in rows] + [4])
print(f"{'test':<{width}}  {'time':>8}  outcome")
for name, took, outcome in rows:
    print(f"{name:<{width}}  {took:>8}  {outcome}")
PYEOF
echo
cat "$LOGS/bench.txt"
[[ $BENCH_RC -eq 0 ]] || { echo "benchmark exit status $BENCH_RC"; tail -n 20 "$LOGS/bench.err"; }
[[ $TEST_RC -eq 0 ]] || exit "$TEST_RC"
exit "$BENCH_RC"
