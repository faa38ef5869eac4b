# Twelfth session (issue 23, item 4), second call: the forward variants at 128, 4096 and 32768 rows (bf16 hidden
# 4096) in turns; then PATCH (a launcher change, untracked here so that it travels) applied on the device's copy
# and `opbuilder bench fused_add_rmsnorm` against Liger at those sizes.   (carry .whl and build/quick_rms)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/liger*.whl
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=/tmp/site:benchmarks/tuning
timeout 240 python3 benchmarks/tuning/quick_rmsnorm.py --rows ${ROWS:-128,4096,32768} --no-backward --rounds ${ROUNDS:-5} 2>&1 \
  | grep -v Warning | grep -v "^ptxas"
[ -n "$PATCH" ] || exit 0
patch -s -p1 < "$PATCH" && python3 -m opbuilder build fused_add_rmsnorm >/tmp/build2.log 2>&1 || tail -5 /tmp/build2.log
echo "== bench with $PATCH"
timeout 200 python3 -m opbuilder bench fused_add_rmsnorm --shapes 128x4096 4096x4096 32768x4096 --dtype bf16 \
  --no-host --json "$OUT/bench.json" 2>&1 | grep -v Warning | tail -25
exit 0
