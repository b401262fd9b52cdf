#!/usr/bin/env bash
# One H100: a torch_dist checkpoint written with --async-save resumes with the uninterrupted run's losses (megatron engine, NCCL, bf16).
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
RUN="python3 -m torch.distributed.run --standalone --nproc_per_node 1 pretrain_gpt.py --mock-data --tokenizer-type NullTokenizer --vocab-size 50257 --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --micro-batch-size 4 --global-batch-size 8 --num-workers 0 --lr 1e-4 --log-interval 1 --eval-iters 0 --train-iters 10 --hidden-dropout 0 --attention-dropout 0 --bf16 --data-cache-path /tmp/cache"
echo "== $RUN --save /tmp/ck --save-interval 5 --async-save" | tee $OUT/resume.log
$RUN --save /tmp/ck --save-interval 5 --async-save > /tmp/a.log 2>&1; echo "rc=$?" | tee -a $OUT/resume.log
grep -E 'saving|saved|iteration +[0-9]+/' /tmp/a.log | sed 's/| elapsed.*lm loss/| lm loss/; s/| loss scale.*//' | tee -a $OUT/resume.log
echo 5 > /tmp/ck/latest_checkpointed_iteration.txt
echo "== $RUN --load /tmp/ck --save /tmp/ck2   (iteration 5 of the run above)" | tee -a $OUT/resume.log
$RUN --load /tmp/ck --save /tmp/ck2 > /tmp/b.log 2>&1; echo "rc=$?" | tee -a $OUT/resume.log
grep -E 'checkpoint|iteration +[0-9]+/' /tmp/b.log | sed 's/| elapsed.*lm loss/| lm loss/; s/| loss scale.*//' | tee -a $OUT/resume.log
tail -c 2000 /tmp/b.log > $OUT/resume-tail.log
