# Eighteenth session (issue 23): fused_matmul_add_relu takes only the workspace its algorithm needs. The op's CUDA
# tests with the change, host_overhead.py for the op with it, without it (the three launcher files of the
# previous commit copied to build/old_fmar here and carried), and with it again; the new test without the change.
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== fused_matmul_add_relu tests (the change)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_fused_matmul_add_relu.py tests/torchop \
  -k "matmul or Linear or linear" 2>&1 | grep -E "passed|failed|^FAILED" | tail -5
h() { timeout 60 python3 benchmarks/host_overhead.py --device cuda fused_matmul_add_relu 2>&1 | grep -E "^fused_matmul" | sed "s/^/$1 /"; }
h after
mkdir -p /tmp/new_fmar && cp kernels/fused_matmul_add_relu/{binding.cpp,fused_matmul_add_relu.cu,fused_matmul_add_relu.cuh} /tmp/new_fmar/
swap() { cp "$1"/* kernels/fused_matmul_add_relu/ && python3 -m opbuilder build fused_matmul_add_relu >/tmp/b.log 2>&1 || tail -3 /tmp/b.log; }
swap build/old_fmar
echo "== the new test without the change (expect both to fail)"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/ops/test_fused_matmul_add_relu.py -k workspace_its 2>&1 \
  | grep -E "passed|failed|^FAILED|^E  .*assert" | tail -6
h before
swap /tmp/new_fmar
h after2
