# The compiled and eager training step of two trees on one machine, in turns (issue 23): this checkout and the
# one `patch -R` of PATCH gives (the previous tree), each installed in its turn. Make the patch here first, left
# untracked so that the device's copy of the tree carries it (the device has no git):
#   git diff OLD HEAD -- kernels ops opbuilder > ab.patch
#   OUT=$OUT PATCH=ab.patch bash benchmarks/tuning/gpu_ab.sh
source benchmarks/tuning/prelude.sh
nvidia-smi --query-gpu=name --format=csv,noheader
here=$(pwd)
rm -rf /tmp/old && cp -r "$here" /tmp/old && (cd /tmp/old && patch -s -R -p1 < "$here/$PATCH") || exit 1
install() { (cd "$1" && python3 -m pip install --no-deps --no-build-isolation -e . -q >/tmp/install_ab.log 2>&1); }
run() {  # $1 tree, $2 label, $3 cache
  install "$1"
  (cd "$1" && OPB_CACHE_DIR=$3 python3 -m opbuilder build --all >/dev/null 2>&1
   OPB_CACHE_DIR=$3 CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/train_step.py --device cuda --compile \
     --rounds ${ROUNDS:-11} --steps 10 --sizes ${SIZES:-1024,4096,8192} --json "$OUT/ab_$2.json" 2>&1 \
     | grep -E "^(FFNModel|Model)" | sed "s/^/$2 /")
}
for turn in 1 2; do
  run /tmp/old "old$turn" /tmp/opb-old
  run "$here" "new$turn" /tmp/opb-cache
done
