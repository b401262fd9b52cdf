#!/bin/bash
# One node: every GPU on it, one process each (GPUS=2 runs two CPU processes where there is none).
# The README's quick start at any size: extra arguments go to pretrain_gpt.py and override these.
#
#     bash examples/single_node.sh --data-path data/my-gpt2_text_document --tokenizer-type GPT2BPETokenizer \
#         --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --num-layers 24 --hidden-size 1024 ...
#     bash examples/single_node.sh --dry-run     # print the command; run nothing
#
# Environment: GPUS (default: the visible GPUs, CUDA_VISIBLE_DEVICES or nvidia-smi's list; 2 CPU
# processes on a machine without one), TP (default 2, 1 on one GPU), PYTHON (default: the repo's
# .venv/bin/python, made by tools/setup.sh, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
if [[ -z ${GPUS:-} ]]; then
    if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
        GPUS=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -cvE '^(|-1|NoDevFiles)$' || true)
    else
        GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    fi
    ((GPUS > 0)) || GPUS=2
fi
TP=${TP:-$((GPUS > 1 ? 2 : 1))}
dry_run=0 args=()
for arg in "$@"; do
    if [[ $arg == --dry-run ]]; then dry_run=1; else args+=("$arg"); fi
done
cmd=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$GPUS"
     pretrain_gpt.py --schedule gpt_tp --tensor-model-parallel-size "$TP" ${args[@]+"${args[@]}"})
if ((dry_run)); then
    printf '%q ' "${cmd[@]}"
    echo
else
    exec "${cmd[@]}"
fi
