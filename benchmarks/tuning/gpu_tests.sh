# The device's test calls (issue closing checks): OUT=$OUT bash benchmarks/tuning/gpu_tests.sh PART
#   PART 1: `opbuilder check relu --device cuda` and tests/torchop tests/ops tests/dispatch; PART 2: the rest.
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${1:-1}" = 1 ]; then
  echo "== opbuilder check relu --device cuda"; timeout 150 python3 -m opbuilder check relu --device cuda 2>&1 | tail -6
  dirs="tests/torchop tests/ops tests/dispatch"
else
  dirs="tests/jit tests/tools tests/package"
fi
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest $dirs -q -n 14 -p no:cacheprovider -rsfE >"$OUT/tests$1.log" 2>&1
echo "pytest exit: $?"; grep -E "passed|failed" "$OUT/tests$1.log" | tail -2; grep -E "^(FAILED|ERROR)" "$OUT/tests$1.log" | head -20
echo "== skip reasons (count)"; grep "^SKIPPED" "$OUT/tests$1.log" | sed -E "s/^SKIPPED \[([0-9]+)\] [^ ]+ /\1 /" | awk "{n=\$1; \$1=\"\"; c[\$0]+=n} END {for (k in c) print c[k], k}" | sort -rn | head -15
