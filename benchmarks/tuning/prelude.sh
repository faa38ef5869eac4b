# Sourced on the device: install the checkout and build every op once (a no-op on a warm machine).
export TORCH_CUDA_ARCH_LIST=9.0 OPB_CACHE_DIR=/tmp/opb-cache PYTHONUNBUFFERED=1
(cd /tmp && python3 -c "import opbuilder" 2>/dev/null) || python3 -m pip install --no-deps --no-build-isolation -e . -q >/tmp/install.log 2>&1
python3 -m opbuilder build --all >/tmp/build.log 2>&1 || tail -20 /tmp/build.log
