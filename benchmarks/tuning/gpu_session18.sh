# Eighteenth session (issue 23): both device scripts in one call (machines are scarce): the workspace change,
# then the longer dim-256 step run with the time left. OUT=$OUT bash benchmarks/tuning/gpu_session18.sh
start=$SECONDS
bash benchmarks/tuning/gpu_workspace.sh
left=$((540 - (SECONDS - start)))
echo "== $((SECONDS - start)) s used, $left s left"
if [ "$left" -gt 150 ]; then
  source benchmarks/tuning/prelude.sh
  timeout $((left - 10)) python3 benchmarks/train_step.py --device cuda --compile --rounds ${ROUNDS256:-21} --steps 10 \
    --sizes 256,1024,1024 --json "$OUT/train256.json" 2>&1 | grep -v Warning | tail -12
fi
