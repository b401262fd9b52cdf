#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the CUDA tests (tests/test_cuda.py: kernels and
# one-device recipes against HF), the trainer on one GPU (megatron-core's CUDA paths, not the CPU
# shim), the GPU benchmark grid (tools/bench.py --grid gpu), the GPU's hardware profile for the
# time model (tools/calibrate.py) and FP8 against bf16, eager and compiled (tools/bench_fp8.py --grid gpu).
#
#   bash tools/gpu_check.sh [OUTDIR]     # default: docs/benchmarks/gpu-<date>
#
# Runs with PYTHON (default: the repo's .venv/bin/python where tools/setup.sh made one, else the
# machine's own python3 and torch). Wheels in .whl/ (e.g. the transformers version this repo was
# tested with) are installed first into a private folder, for machines that cannot reach a package
# index. Each step has its own time limit, so that one slow step leaves the others'
# results; everything goes to OUTDIR: env.txt, test_cuda.log, train-gpu.log, bench-gpu.{log,json,png},
# calibration.json (and calibrate.log), bench-fp8.{log,json} (and bench-fp8-trainer.log, the trainer's
# own output in those rows).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
out=${1:-docs/benchmarks/gpu-$(date +%F)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
fi
{
    date -u +"%F %T UTC"
    echo "git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff HEAD --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$PYTHON" -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| transformers', transformers.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name())"
} 2>&1 | tee "$out/env.txt"

echo "== $PYTHON -m pytest -q -rs -s tests/test_cuda.py" | tee "$out/test_cuda.log"
timeout "${CUDA_TESTS_TIMEOUT:-180}" "$PYTHON" -m pytest -q -rs -s tests/test_cuda.py 2>&1 | tee -a "$out/test_cuda.log"

: >"$out/train-gpu.log"
for flags in "--schedule gpt_tp" "--schedule gpt_fused --bf16"; do
    echo "== torchrun --nproc_per_node 1 pretrain_gpt.py $flags --train-iters 40" | tee -a "$out/train-gpu.log"
    # shellcheck disable=SC2086  # the flags are words
    timeout "${TRAIN_TIMEOUT:-120}" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 pretrain_gpt.py \
        $flags --train-iters 40 --log-interval 10 --eval-interval 40 --eval-iters 2 2>&1 | tee -a "$out/train-gpu.log"
done

echo "== $PYTHON tools/bench.py --grid gpu" | tee "$out/bench-gpu.log"
timeout "${BENCH_TIMEOUT:-420}" "$PYTHON" tools/bench.py --grid gpu --json "$out/bench-gpu.json" \
    --plot "$out/bench-gpu.png" 2>&1 | tee -a "$out/bench-gpu.log"

echo "== $PYTHON tools/calibrate.py --out $out/calibration.json" | tee "$out/calibrate.log"
timeout "${CALIBRATE_TIMEOUT:-180}" "$PYTHON" tools/calibrate.py --out "$out/calibration.json" 2>&1 | tee -a "$out/calibrate.log"

echo "== $PYTHON tools/bench_fp8.py --grid gpu" | tee "$out/bench-fp8.log"
timeout "${FP8_TIMEOUT:-300}" "$PYTHON" tools/bench_fp8.py --grid gpu --json "$out/bench-fp8.json" \
    2>"$out/bench-fp8-trainer.log" | tee -a "$out/bench-fp8.log"
