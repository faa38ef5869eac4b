# Nineteenth session (issue 23), third call: the mended dispatch test on CUDA, then the compiled dim-256 step.
#   OUT=$OUT bash benchmarks/tuning/gpu_session19b.sh
start=$SECONDS
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 -m pytest tests/dispatch/test_dispatch_builtin.py tests/dispatch/test_dispatch_robust.py -q -n 4 \
  -p no:cacheprovider 2>&1 | tail -2
left=$((560 - (SECONDS - start)))
echo "== $((SECONDS - start)) s used, $left s left"
timeout $((left - 10)) python3 benchmarks/train_step.py --device cuda --compile --rounds ${ROUNDS256:-13} --steps 10 \
  --sizes 256,1024,1024 --json "$OUT/train256c.json" 2>&1 | grep -v Warning | tail -5
exit 0
