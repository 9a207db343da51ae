#!/usr/bin/env bash
# Everything GPU-specific in one go (tools/gpu_check.py): backends on CUDA in bf16, every sync
# mode on NCCL, exact resume and HF export on CUDA, a dead rank on NCCL, elastic mode on NCCL (2
# groups' jobs from tools/elastic_launch.py, a GPU each; `--only elastic` runs it alone). One line
# per check, then "N passed, N failed, N skipped". Without a GPU every check is skipped (exit 0), as CI runs it.
# Uses .venv when there is one (make test builds it), else the python on PATH with a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
exec "$PY" tools/gpu_check.py "$@"
