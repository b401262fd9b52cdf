#!/usr/bin/env bash
# Create ./.venv with everything megatron_slapo needs; safe to run again.
# torch is installed first and pinned: on a CPU-only machine `torch==2.13.0` resolves to the local
# CPU wheel; a plain `torch` (or a newer pin) would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
fi
.venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
.venv/bin/pip install -q --disable-pip-version-check --no-deps -e .
.venv/bin/python -c "import torch, transformers, megatron.core; print('setup ok: torch', torch.__version__, '| transformers', transformers.__version__)" 2>/dev/null
