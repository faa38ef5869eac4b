# One device call for issue 23's single-GPU figures: OUT=$OUT bash benchmarks/tuning/gpu_train.sh
# train_step.py (eager and --compile) at the default sizes, then the compiled case at dim 256 once more with
# OPB_CXX_AUTOGRAD=0 (the registered ops on their Python formulas: the comparison for the C++ kernels).
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
echo "== train_step --compile"; timeout 330 python3 benchmarks/train_step.py --device cuda --compile --rounds ${ROUNDS:-5} --json "$OUT/train.json" 2>&1 | grep -v Warning | tail -9
echo "== the same at dim 256, OPB_CXX_AUTOGRAD=0"
OPB_CXX_AUTOGRAD=0 timeout 150 python3 benchmarks/train_step.py --device cuda --compile --rounds ${ROUNDS:-5} --sizes 256,1024,1024 2>&1 | grep -v Warning | tail -6
