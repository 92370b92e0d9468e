#!/usr/bin/env bash
# The GPU measurements of issue 15, in one run that fits a short lease of a GPU machine.
#
# Runs, each under its share of a deadline (DEADLINE_S seconds from the start, default 520) so
# that a slow part cannot starve the others, and each writing its log to $OUT (or ./gpu_out):
#   1. benchmarks/resnet50.py: ResNet-50, batch 256, bfloat16 activations, float32 curvature;
#      THOR's check / plain / amortized step against SGD, Adam and Muon, compile times;
#   2. benchmarks/mnist.py (its defaults: THOR, SGD, Adam and Muon on the MLP and the CNN);
#   3. benchmarks/check_step.py --tables rows (widths 512, 1024; batches 128, 512): the plain
#      step from the gradient or from the rows;
#   4. tests/test_exactness.py: the dense float64 references, on the GPU.
# A missing Python package can be installed from wheels in ./.whl first (mlxtend, which the
# GPU image lacks); PYTHONPATH then holds them and the repository.
#
#   bash benchmarks/gpu.sh
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
START=$(date +%s)
DEADLINE=$((START + ${DEADLINE_S:-520}))

# run NAME SHARE_S CMD...: CMD with a timeout of min(SHARE_S, time left), log in $OUT/NAME.txt.
run() {
  local name=$1 share=$2
  shift 2
  local left=$((DEADLINE - $(date +%s)))
  ((left < share)) && share=$left
  if ((share < 10)); then echo "== $name: skipped, no time left"; return; fi
  echo "== $name (at most ${share} s): $*"
  local t0=$(date +%s)
  timeout "$share" "$@" >"$OUT/$name.txt" 2>&1
  echo "== $name: exit $? after $(($(date +%s) - t0)) s"
  grep -v -i "warn\|it/s\]\|s/it\]" "$OUT/$name.txt" | tail -n 30
}

nvidia-smi -L 2>/dev/null
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, jax.devices())"
run resnet50 280 python3 benchmarks/resnet50.py --repeats 4
run mnist 100 python3 benchmarks/mnist.py --out "$OUT/mnist.json" --plot "$OUT/mnist.png"
run check_step_rows 100 python3 benchmarks/check_step.py --tables rows --widths 512 1024 \
  --batches 128 512 --repeats 10
run test_exactness 40 python3 -m pytest -q -x tests/test_exactness.py
