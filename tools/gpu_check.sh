#!/usr/bin/env bash
# Everything GPU-specific in one go (tools/gpu_check.py): on one GPU each backend's bf16 step
# (tokens/s, MFU), the dry run's memory estimate against the measured peak, the codecs' speed, exact
# resume and HF export on CUDA, gloo's collectives on CUDA, the overlapped sync and the tuner with two
# processes of the GPU; with several GPUs every sync mode on NCCL, a dead rank, elastic mode. One line
# per check, then "N passed, N failed, N skipped". Without a GPU every check is skipped (exit 0), as CI
# runs it. --plan prints what would run and each check's budget.
#
# --install (first argument): first install the wheels tools/gpu_bundle.sh put in .gpu-carry/ into
# the python that runs the checks, offline (pip --no-index), for a machine with no network whose
# image lacks DeepSpeed, megatron-core and torchft: the device tool's
#   run(carry=[".gpu-carry"], command="bash tools/gpu_check.sh --install")
# Each extra is installed on its own, so a wheel that could not be built costs only its checks.
# Uses $GPU_CHECK_PYTHON, else .venv when there is one (make test builds it), else the python on PATH;
# the code is this tree's (PYTHONPATH), whatever fl-megatron the environment holds.
set -euo pipefail
cd "$(dirname "$0")/.."
export GPU_CHECK_STARTED="${GPU_CHECK_STARTED:-$(date +%s.%N)}"
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
PY=${GPU_CHECK_PYTHON:-$PY}
if [ "${1:-}" = "--install" ]; then
  shift
  if [ ! -d .gpu-carry ]; then
    echo "gpu_check: --install: no .gpu-carry/ here (build it with tools/gpu_bundle.sh, carry it to this machine)" >&2
    exit 2
  fi
  began=$(date +%s)
  for spec in "fl-megatron" "fl-megatron[deepspeed]" "fl-megatron[megatron]" "fl-megatron[elastic]"; do
    if ! log=$("$PY" -m pip install -q --no-index --find-links .gpu-carry "$spec" 2>&1); then
      echo "gpu_check: --install: $spec could not be installed from .gpu-carry (its checks skip): $(tail -n 1 <<<"$log")"
    fi
  done
  echo "gpu_check: installed the carried wheels offline in $(( $(date +%s) - began )) s"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" tools/gpu_check.py "$@"
