#!/usr/bin/env bash
# Issue #51's CPU figures on the host CPU of a lent device machine (the device tool): its host
# is another CPU kind than this machine's (an Intel Xeon where this one is an AMD EPYC), so the
# nano GPT against nanoGPT, per step and for a whole 2000-step run, and attend() against torch
# SDPA can be measured there too. Everything runs on two CPU cores (`taskset`, two logical CPUs
# of different physical cores), the size of the machines the figures here come from; JAX sees
# the CPU only and torch no GPU. Per step: nanoGPT, the default (rotary; bfloat16 products where
# the CPU has AVX512_BF16 or AMX) and the same with float32 products (rotary_f32).
#
# Here, once: the wheels of gpu_device.sh's header in .whl/, nanoGPT's export in .whl/nanogpt,
# and Tiny Shakespeare, which does not travel either:
#   mkdir -p .whl/data/tinyshakespeare && cp ../shared/data/tinyshakespeare/input.txt $_
# There (device run, carry [".whl"]):
#   bash experiments/benchmarks/cpu_device.sh [PER_STEP_S ATTENTION_S WHOLE_S WHOLE_ROUNDS]
# Each step writes $OUT/<step>.txt under its own deadline (device_setup.sh's `step`). The
# defaults (240 + 80 + 200 s, one whole-run pair) fit one 10-minute call on the Intel host seen
# so far (three per-step rounds there took about 210 s, a whole pair about 180 s); more
# whole-run pairs take a call of their own: `cpu_device.sh 0 0 560 3`.
# LOCAL_CHECK=1 installs nothing and runs short versions on this machine (a check of the script).
set -uo pipefail
per_step_s=${1:-240}; attention_s=${2:-80}; whole_s=${3:-200}; whole_rounds=${4:-1}
OUT=${OUT:-/tmp/cpu_device_out}
source experiments/benchmarks/device_setup.sh  # the wheels, PYTHONPATH, $nanogpt, $smoke, step
export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
data=$PWD/.whl/data
iters="--rounds=3 --iters=200 --skip=30"; wall_steps=2000; reps=3; seq=512,1024
if [ -n "$smoke" ]; then
  data=$PWD/../shared/data; iters="--rounds=1 --iters=40 --skip=10"; wall_steps=20; reps=1
  seq=128
fi
# Two logical CPUs on different physical cores (hyperthreads of one core would halve each).
cores=$(python3 - <<'PY'
import os
picked, seen = [], set()
for cpu in sorted(os.sched_getaffinity(0)):
  path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
  try:
    siblings = open(path).read().strip()
  except OSError:
    siblings = str(cpu)
  if siblings not in seen:
    seen.add(siblings)
    picked.append(cpu)
print(",".join(map(str, picked[:2])))
PY
)
{
  date -u
  uptime
  lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|L2|L3"
  echo "cores used: $cores"
  taskset -c "$cores" python3 experiments/benchmarks/machine.py
  python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', \
torch.__version__)" 2>&1
} | tee "$OUT/device.txt"
pin="taskset -c $cores"
step per_step "$per_step_s" $pin python3 experiments/benchmarks/gpt_vs_nanogpt.py $iters \
    --contenders=nanogpt,rotary,rotary_f32 --wall_steps=0 --nanogpt_dir="$nanogpt" \
    --data_dir="$data"
step attention "$attention_s" $pin python3 experiments/benchmarks/attention.py --seq=$seq \
    --reps=$reps --impls=blocked,torch --memory-seq=''
step whole "$whole_s" $pin python3 experiments/benchmarks/gpt_vs_nanogpt.py --rounds=0 \
    --wall_steps=$wall_steps --wall_contenders=nanogpt,rotary --wall_rounds="$whole_rounds" \
    --nanogpt_dir="$nanogpt" --data_dir="$data"
uptime | tee -a "$OUT/device.txt"
