# Tenth session's device checks (issue 23): OUT=$OUT bash benchmarks/tuning/gpu_verify.sh PART
#   PART tests:    the CUDA tests of tests/torchop, tests/ops, tests/dispatch (gpu_tests.sh 1)
#   PART mutants:  the wrapped-gradient test against two mutations of the one-pass condition (C++ and Python),
#                  each expected to fail it; then host_overhead.py on CUDA
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:-tests}" in
tests) bash benchmarks/tuning/gpu_tests.sh 1 ;;
mutants)
  t=tests/torchop/test_cxx_autograd.py::test_linear_backward_keeps_wrapped_gradients_off_the_one_pass
  echo "== unmutated"; timeout 120 python3 -m pytest -q -p no:cacheprovider "$t" 2>&1 | tail -1
  h=kernels/fused_matmul_add_relu/fused_matmul_add_relu_autograd.h
  cp $h /tmp/h.orig
  sed -i 's/return !t.key_set().has_any(wrapped);/(void)wrapped; return true;/' $h
  grep -c "return true;" $h
  echo "== C++ plain() always true (expect the cxx cases to fail)"
  timeout 240 python3 -m pytest -q -p no:cacheprovider "$t" -k cxx 2>&1 | tail -1
  cp /tmp/h.orig $h
  p=ops/fused_matmul_add_relu.py
  cp $p /tmp/p.orig
  sed -i 's/            and not _wrapped(grad) and not _wrapped(out))/            )/; s/grad.is_cuda and type(grad) is torch.Tensor and type(out) is torch.Tensor and /grad.is_cuda and /' $p
  grep -n "return (grad.is_cuda" -A2 $p
  echo "== Python _one_pass without its type and wrapper checks (expect the python cases to fail)"
  timeout 120 python3 -m pytest -q -p no:cacheprovider "$t" -k python 2>&1 | tail -1
  cp /tmp/p.orig $p
  echo "== host_overhead --device cuda"
  timeout 200 python3 benchmarks/host_overhead.py --device cuda --json "$OUT/host.json" 2>&1 | tail -17 ;;
esac
