#!/usr/bin/env bash
# experiments/benchmarks/gpu.py on a lent GPU machine (the device tool), in one call that ends
# before the lease does: the device image has jax with CUDA, torch, flax, optax and orbax, but
# not the rest of attnlab's dependencies, and no network.
#
# Here, once: the wheels of the missing packages for the device's Python (3.12), in the ignored
# folder .whl/ (carried with the call):
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
#       ml_collections tensorflow-datasets array_record dm-tree immutabledict simple-parsing \
#       docstring_parser tensorflow-metadata googleapis-common-protos termcolor toml tensorboardX \
#       fontpkg fontpkg-noto-sans-devanagari flax orbax-checkpoint optax
#   pip wheel --no-deps -w .whl promise          # an sdist only
# nanoGPT comes from ../shared/anchors/nanogpt, which does not travel: copy it into .whl/nanogpt.
# (device_setup.sh installs them there.) There (device run, carry [".whl"]):
#   bash experiments/benchmarks/gpu_device.sh [TRAIN_S PROFILE_S ATTENTION_S TESTS_S]
# Each step runs under its own deadline (timeout kills the step's whole process group) and
# writes its output to $OUT/<step>.txt; a step that runs out of time keeps what it printed.
# LOCAL_CHECK=1 skips the install and runs everything as --smoke (a CPU check of this script).
set -uo pipefail
train_s=${1:-220}; profile_s=${2:-60}; attention_s=${3:-190}; tests_s=${4:-80}
OUT=${OUT:-/tmp/gpu_device_out}
source experiments/benchmarks/device_setup.sh  # the wheels, PYTHONPATH, $nanogpt, $smoke, step
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import jax, flax, torch; print('jax', jax.__version__, 'flax', flax.__version__, \
'torch', torch.__version__, 'cuda', torch.version.cuda, jax.devices())" 2>&1
  lscpu | grep -E "Model name|^CPU\(s\)"
} | tee "$OUT/device.txt"

step train "$train_s" python3 experiments/benchmarks/gpu.py --parts=train --rounds=2 \
    --iters=40 --skip=10 --nanogpt_dir="$nanogpt" $smoke
step profile "$profile_s" python3 experiments/benchmarks/gpu.py --parts=profile $smoke
step attention "$attention_s" python3 experiments/benchmarks/gpu.py --parts=attention \
    --rounds=1 --reps=10 --seq=1024,2048,4096,8192 $smoke
# The fast tests on the GPU, 8 workers sharing it (no preallocation: each takes what it needs);
# -v names each test as it ends, so a run stopped at its deadline still says what failed.
# ../shared/data does not travel: the tests that read it skip.
if [ -z "$smoke" ]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false SIGNAL=INT step tests "$tests_s" python3 -m pytest -v \
      -m "not slow" -n 8 -p no:cacheprovider
  echo "passed $(grep -c ' PASSED ' "$OUT/tests.txt"), failed $(grep -c ' FAILED ' \
"$OUT/tests.txt"), skipped $(grep -c ' SKIPPED ' "$OUT/tests.txt")"
  grep -E " (FAILED|ERROR) |^(FAILED|ERROR)" "$OUT/tests.txt" | head -40
fi
