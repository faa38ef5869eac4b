# Issue 23: where each parallel plan's step goes on 2 GPUs (tp_profile.py --plan: step time, the GPU's NCCL and
# compute kernel time a step, the CPU table), ours and PyTorch's.   OUT=$OUT bash benchmarks/tuning/gpu_plan_profile.sh
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for plan in ${PLANS:-FSDP2 TP+SP DDP}; do
  name=${plan/+/-}  # the device tool brings back no file with a '+' in its name
  timeout 200 torchrun --nproc_per_node 2 benchmarks/tuning/tp_profile.py --plan "$plan" --steps ${STEPS:-10} \
    --rows ${ROWS:-14} --out "$OUT/$name" >"$OUT/profile_$name.log" 2>&1
  echo "== $plan exit $?"; grep "^== " "$OUT/profile_$name.log"
done
