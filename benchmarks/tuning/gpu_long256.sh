# Eighteenth session (issue 23): the dim-256 step targets (eager >= 1.0, compiled >= 1.0) with more rounds than
# the usual call, so the intervals can settle them; then dim 1024 at the usual rounds. OUT=$OUT bash this.
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
echo "== train_step --compile, dim 256, ${ROUNDS256:-31} rounds"
timeout 330 python3 benchmarks/train_step.py --device cuda --compile --rounds ${ROUNDS256:-31} --steps 10 \
  --sizes 256,1024,1024 --json "$OUT/train256.json" 2>&1 | grep -v Warning | tail -12
echo "== train_step, dim 1024, 9 rounds"
timeout 150 python3 benchmarks/train_step.py --device cuda --rounds 9 --steps 10 --sizes 1024,4096,8192 \
  --json "$OUT/train1024.json" 2>&1 | grep -v Warning | tail -8
