# FusedLinearReLU's one-pass ReLU + bias backward on the GPU (issue 23): its tests, the kernel against ATen's two
# passes, a dim-1024 step's kernels, and ncu's view of the add+RMSNorm 128 x 4096 case beside Liger's.
#   OUT=$OUT bash benchmarks/tuning/gpu_relu_bias.sh [ncu]   (carry .whl: liger-kernel, for ncu)
# TRAIN=1 then times the training step (train_step.py --compile, ${ROUNDS:-25} rounds) within ${LIMIT:-380} s.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/liger*.whl && export PYTHONPATH=/tmp/site
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== tests"
timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/ops/test_fused_matmul_add_relu.py \
  ${TESTS:-tests/torchop/test_cxx_autograd.py} >"$OUT/tests.log" 2>&1
echo "pytest exit: $?"; grep -E "passed|failed" "$OUT/tests.log" | tail -2; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head
echo "== relu_bias_probe"
timeout 120 python3 benchmarks/tuning/relu_bias_probe.py 2>&1 | grep -v Warning
echo "== step_kernels FFNModel 1024"
timeout 120 python3 benchmarks/tuning/step_kernels.py --model FFNModel --rows 14 2>&1 | grep -v Warning
if [ "${TRAIN:-0}" = 1 ]; then
  echo "== train_step --compile, ${ROUNDS:-25} rounds of 10 steps"
  timeout ${LIMIT:-380} python3 benchmarks/train_step.py --device cuda --compile --rounds ${ROUNDS:-25} --steps 10 \
    --json "$OUT/train.json" 2>&1 | grep -v Warning | tail -9
fi
[ "${1:-}" = ncu ] || exit 0
echo "== ncu add+RMSNorm 128x4096"
M=gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,smsp__inst_executed.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__cycles_active.avg
for w in ours liger; do
  timeout 120 ncu --metrics $M --launch-skip 3 --launch-count 1 --kernel-name regex:'rms|forward' \
    python3 benchmarks/tuning/liger_ncu.py $w 2>&1 | grep -E "forward|rms|duration|grid|block_size|registers|inst_exec|dram__|cycles_active|done" | head -20
done
