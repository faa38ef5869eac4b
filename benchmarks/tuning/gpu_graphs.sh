# Issue 23: whole training steps under CUDA graphs (captured by hand, and torch.compile's reduce-overhead):
# their tests, then train_step.py --graphs --compile.   OUT=$OUT bash benchmarks/tuning/gpu_graphs.sh
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
echo "== tests"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -n 4 -rsfE tests/torchop/test_cuda_graphs.py \
  tests/ops -k "graph" >"$OUT/graphs_tests.log" 2>&1
echo "pytest exit: $?"; grep -E "passed|failed" "$OUT/graphs_tests.log" | tail -2
grep -E "^(FAILED|ERROR|SKIPPED)|Error" "$OUT/graphs_tests.log" | head -20
echo "== train_step --graphs --compile, ${ROUNDS:-15} rounds of ${STEPS:-10} steps"
CUDA_VISIBLE_DEVICES=0 timeout ${LIMIT:-300} python3 benchmarks/train_step.py --device cuda --graphs --compile \
  --rounds ${ROUNDS:-15} --steps ${STEPS:-10} --sizes ${SIZES:-256,1024,1024 1024,4096,8192} \
  --json "$OUT/train.json" >"$OUT/train.log" 2>&1
echo "train_step exit: $?"; grep -v Warning "$OUT/train.log" | tail -8
