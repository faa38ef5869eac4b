# Where a step's host time goes inside the step, ours beside PyTorch's (benchmarks/tuning/insitu_host.py), on the GPU:
# wall clock, the thread's CPU time, and wall clock with Python's GC off.
#   OUT=$OUT bash benchmarks/tuning/gpu_insitu.sh
source benchmarks/tuning/prelude.sh
for m in ${MODELS:-FFNModel Model}; do
  for v in "--clock wall" "--clock cpu" "--clock wall --gc-off"; do
    timeout 150 python3 benchmarks/tuning/insitu_host.py --model $m --rounds ${ROUNDS:-41} $v 2>&1 | grep -v Warning \
      | tee "$OUT/insitu_${m}_$(echo $v | tr -d ' -').txt"
  done
done
