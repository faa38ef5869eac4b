# One device call for the compile-time inline rule (issue 23): OUT=$OUT bash benchmarks/tuning/gpu_inline.sh
# Its tests and the ops' compile tests on CUDA, then train_step.py --compile: ours as compiled by default (small
# calls traced as their definitions), ours with our kernels at every size, and PyTorch's layers, one run.
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
echo "== tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 ${TESTS:-tests/torchop/test_inline.py tests/ops -k "inline or compile"} \
  2>&1 | grep -E "passed|failed|Error|^E " | tail -${TEST_LINES:-12}
echo "== train_step --compile"
timeout 420 python3 benchmarks/train_step.py --device cuda --compile --rounds ${ROUNDS:-5} \
  --sizes ${SIZES:-256,1024,1024 512,2048,2048 1024,4096,8192} --json "$OUT/train.json" 2>&1 | grep -v Warning | tail -10
