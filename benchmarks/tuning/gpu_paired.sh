# Issue 23's speedups with paired rounds and 95 % intervals (benchmarks/paired.py), on one 2-GPU machine:
#   OUT=$OUT bash benchmarks/tuning/gpu_paired.sh 1   # train_step.py --compile on GPU 0, many short rounds
#   OUT=$OUT bash benchmarks/tuning/gpu_paired.sh 2   # multi_gpu.py on both GPUs, then the router's thread test
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
if [ "${1:-1}" = 1 ]; then
  echo "== train_step --compile, ${ROUNDS:-31} rounds of ${STEPS:-10} steps"
  CUDA_VISIBLE_DEVICES=0 timeout ${LIMIT:-420} python3 benchmarks/train_step.py --device cuda --compile \
    --rounds ${ROUNDS:-31} --steps ${STEPS:-10} --sizes ${SIZES:-256,1024,1024 1024,4096,8192} \
    --json "$OUT/train.json" 2>&1 | grep -v Warning | tail -8
else
  echo "== multi_gpu default size, ${ROUNDS:-15} rounds"
  timeout 300 torchrun --nproc_per_node 2 benchmarks/multi_gpu.py --rounds ${ROUNDS:-15} --json "$OUT/mg.json" 2>&1 \
    | grep -v Warning | tail -7
  echo "== multi_gpu dim 4096, ${ROUNDS4096:-7} rounds"
  timeout 240 torchrun --nproc_per_node 2 benchmarks/multi_gpu.py --rounds ${ROUNDS4096:-7} --dim 4096 --hidden 16384 \
    --json "$OUT/mg4096.json" 2>&1 | grep -v Warning | tail -6
  echo "== tests"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -n 4 tests/dispatch/test_dispatch_builtin.py \
    tests/torchop/test_inline.py 2>&1 | grep -E "passed|failed|^E " | tail -8
fi
