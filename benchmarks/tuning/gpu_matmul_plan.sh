# Issue 23, the twelfth session of benchmarks/NOTES.md: fused_matmul_add_relu's cuBLASLt descriptor and layouts
# kept per thread. PART plan: the new tests, then host_overhead.py (fused_matmul_add_relu) with the change, without
# it (plan.patch reversed on the device copy), with it again; and the new tests against a mutation that sets the
# bias pointer only when the descriptor is made (expect the same-problem test to fail). Make plan.patch here,
# untracked:
#   git diff 3e30611 2da52e2 -- kernels/fused_matmul_add_relu/fused_matmul_add_relu.cu > plan.patch
#   OUT=$OUT bash benchmarks/tuning/gpu_matmul_plan.sh plan
# PART threads: the threads test, then the same against a mutation that shares one map of descriptors between
# threads (a mutex around the map only; expect it to fail), three times each; then train_step.py (gpu_paired.sh 1).
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
f=tests/ops/test_fused_matmul_add_relu.py k="same_problem_with_new_operands_each_call or threads_calling_one_problem"
b() { python3 -m opbuilder build fused_matmul_add_relu >/tmp/b.log 2>&1 || tail -3 /tmp/b.log; }
case "${1:-plan}" in
plan)
h() { timeout 60 python3 benchmarks/host_overhead.py --device cuda fused_matmul_add_relu 2>&1 \
  | grep -E "^fused_matmul_add_relu " | sed "s/^/$1 /"; }
echo "== the new tests"; timeout 100 python3 -m pytest -q -p no:cacheprovider $f -k "$k" 2>&1 | tail -1
h after
patch -s -R -p1 < plan.patch && b
h before
patch -s -p1 < plan.patch && cu=kernels/fused_matmul_add_relu/fused_matmul_add_relu.cu && cp $cu /tmp/cu.orig
python3 - "$cu" <<'PY'
import sys
p = sys.argv[1]; s = open(p).read()
line = "  if (p.bias_vector) OPB_CUBLAS_TRY(set_desc(s->desc.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias_vector));\n"
epi = "  OPB_CUBLAS_TRY(set_desc(s.desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE, plan.epilogue));\n"
assert line in s and epi in s
s = s.replace(line, "").replace(epi, epi + line.replace("s->", "s."))
open(p, "w").write(s)
PY
b
echo "== the new tests against the mutation (expect same_problem to fail)"
timeout 100 python3 -m pytest -q -p no:cacheprovider $f -k "$k" 2>&1 | grep -E "passed|failed|^FAILED" | tail -4
cp /tmp/cu.orig $cu && b
h after2
  ;;
threads)
  cu=kernels/fused_matmul_add_relu/fused_matmul_add_relu.cu && cp $cu /tmp/cu.orig
  t() { for i in 1 2 3; do timeout 100 python3 -m pytest -q -p no:cacheprovider $f -k threads_calling_one_problem 2>&1 \
    | grep -E "passed|failed|^E  .*AssertionError" | tail -2; done; }
  echo "== the threads test"; t
  python3 - "$cu" <<'PY'
import sys
p = sys.argv[1]; s = open(p).read()
old = "  thread_local std::unordered_map<Key, std::unique_ptr<Prepared>, KeyHash> prepared;\n"
assert old in s
s = s.replace(old, "  static std::unordered_map<Key, std::unique_ptr<Prepared>, KeyHash> prepared;\n"
              "  static std::mutex prepared_mutex;\n  std::lock_guard<std::mutex> lock(prepared_mutex);\n")
open(p, "w").write(s)
PY
  b; echo "== the threads test, one map for every thread (expect failures)"; t
  cp /tmp/cu.orig $cu && b
  ROUNDS=${ROUNDS:-21} LIMIT=${LIMIT:-300} bash benchmarks/tuning/gpu_paired.sh 1 ;;
esac
