# Twelfth session (issue 23): softmax without its empty workspace tensor. The CUDA softmax tests with the fix, then
# the new allocation test and host_overhead.py (softmax, relu) with the fix, without it (sm.patch reversed on the
# device copy; make it here: git diff -- kernels/softmax/binding.cpp > sm.patch, untracked), and with it again.
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== softmax tests (the fix)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_softmax.py tests/torchop -k "softmax" 2>&1 | grep -E "passed|failed|^FAILED" | tail -5
h() { timeout 60 python3 benchmarks/host_overhead.py --device cuda softmax relu 2>&1 | grep -E "^(softmax|relu) " | sed "s/^/$1 /"; }
h after
patch -s -R -p1 < sm.patch && python3 -m opbuilder build softmax >/tmp/b.log 2>&1 || tail -3 /tmp/b.log
echo "== the new test without the fix (expect warp and block to fail)"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/ops/test_softmax.py -k workspace 2>&1 | grep -E "passed|failed|^FAILED|^E  .*assert" | tail -6
h before
patch -s -p1 < sm.patch && python3 -m opbuilder build softmax >/tmp/b.log 2>&1 || tail -3 /tmp/b.log
h after2
