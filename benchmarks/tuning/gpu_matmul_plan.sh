# Thirteenth session (issue 23): fused_matmul_add_relu's cuBLASLt descriptor and layouts kept per thread. The new
# tests, then host_overhead.py (fused_matmul_add_relu) with the change, without it (plan.patch reversed on the
# device copy), with it again; and the new tests against a mutation that sets the bias pointer only when the
# descriptor is made (expect the same-problem test to fail). Make plan.patch here, untracked:
#   git diff 3e30611 2da52e2 -- kernels/fused_matmul_add_relu/fused_matmul_add_relu.cu > plan.patch
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
f=tests/ops/test_fused_matmul_add_relu.py k="same_problem_with_new_operands_each_call or threads_calling_one_problem"
b() { python3 -m opbuilder build fused_matmul_add_relu >/tmp/b.log 2>&1 || tail -3 /tmp/b.log; }
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
