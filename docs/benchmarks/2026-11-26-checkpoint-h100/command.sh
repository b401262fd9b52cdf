#!/usr/bin/env bash
# GPU checks of issue 23 (torch_dist checkpoints): run on the device machine from the repo root.
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ date -u +"%F %T UTC"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys,torch,transformers,megatron.core as m;print('python',sys.version.split()[0],'| torch',torch.__version__,'| transformers',transformers.__version__,'| megatron-core',m.__version__,'|',torch.cuda.get_device_name())"; } 2>&1 | tee $OUT/env.txt
RUN="python3 -m torch.distributed.run --standalone"
M="--mock-data --tokenizer-type NullTokenizer --vocab-size 50257 --num-layers 12 --hidden-size 768 --num-attention-heads 12 --micro-batch-size 4 --num-workers 0 --lr 1e-4"
for prec in fp32 bf16; do
  extra=""; [ $prec = bf16 ] && extra="--bf16"
  echo "== $RUN --nproc_per_node 1 tools/bench_checkpoint.py --repeats 3 -- $M --seq-length 1024 $extra" | tee -a $OUT/bench.log
  timeout 160 $RUN --nproc_per_node 1 tools/bench_checkpoint.py --repeats 3 --dir /tmp/bench-$prec --json $OUT/gpu-$prec.json -- $M --seq-length 1024 $extra > $OUT/gpu-$prec.full.log 2>&1
  grep -A4 '^format' $OUT/gpu-$prec.full.log | tee -a $OUT/bench.log; tail -3 $OUT/gpu-$prec.full.log | grep -i error
done
for f in $OUT/*.full.log; do tail -c 3000 $f > $f.tail; rm $f; done
# The TP2 rows (bench-cpu-tp2.log, cpu-tp2.json) came from the same machine's host CPUs (gloo, CUDA hidden), an
# earlier call of this script that also held these lines:
#   echo "== CUDA_VISIBLE_DEVICES= ..." | tee -a $OUT/bench.log
#   CUDA_VISIBLE_DEVICES= timeout 200 $RUN --nproc_per_node 2 tools/bench_checkpoint.py --repeats 2 --dir /tmp/bench-tp2 \
#       --json $OUT/cpu-tp2.json -- --schedule gpt_tp --tensor-model-parallel-size 2 $M --seq-length 128
# Its GPU rows failed there (the timer's all-reduce used a CPU tensor under NCCL; fixed before this run).
