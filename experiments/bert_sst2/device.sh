#!/usr/bin/env bash
# Arms of the BERT study on a lent GPU machine (the device tool), whose image has jax with CUDA,
# flax, optax and orbax but not the rest of attnlab's dependencies, and no network.
#
# Here, once: the wheels of the missing packages (experiments/long_range/device.sh lists them and
# how to fetch them) and SST-2's files, in the ignored folder .whl/ (carried with the call):
#   mkdir -p .whl/data && cp -r ../shared/data/sst2 .whl/data/
#   attnlab data prepare sst2 --data_dir=.whl/tfds --manual_dir=../shared/data
# and the vocabularies the jobs need, learned here into .whl/cache (XDG_CACHE_HOME=.whl/cache, any
# run or `--plan`-free start of the study that builds the task, e.g. one pretraining step).
# There (device run, carry [".whl"]):
#   bash experiments/bert_sst2/device.sh DEADLINE_S FINAL_END_S 'FINAL ARGS' \
#       'NAME|RUN.PY ARGS' 'NAME|RUN.PY ARGS' ...
# Every call must carry .whl: a call without it removes the folder there, SST-2's files with it.
# To finish a study in a second call on the same warm machine, set ROOT to a folder the
# repository ignores (ROOT=$PWD/runs/NAME: it stays between calls) and call the script again
# with the same FINAL ARGS and no jobs (LOCAL_CHECK=1 skips the install: only where the first
# call's /tmp/site is still there).
# Each job runs experiments/bert_sst2/run.py --workdir=ROOT/NAME ARGS, all jobs at once; a job still running after DEADLINE_S gets SIGTERM (the trainer saves
# a checkpoint and stops). Then one more run.py call, in ROOT/all, whose arm folders are links to
# the jobs' arms (their finished runs are skipped), runs with FINAL ARGS for at most
# the script's FINAL_END_S-th second (e.g. the label-efficiency runs). Every run's evaluation records are printed
# and the run folders (metrics, configs, results, timings; no checkpoints) are packed into
# $OUT/bert_device.tgz.
set -uo pipefail
deadline=$1; final_end=$2; final_args=$3; shift 3
# (LOCAL_CHECK=1: skip the install, to check the script on a machine that has the packages)
[ -n "${LOCAL_CHECK:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# The carried cache (.whl/cache/attnlab/tokenizers): vocabularies learned here, so that jobs that
# share one do not learn it at the same time.
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$PWD/.whl/cache}
root=${ROOT:-/tmp/bert_device}
out=${OUT:-/tmp/bert_device_out}
manual=$PWD/.whl/data
tfds=$PWD/.whl/tfds  # SST-2 prepared here (attnlab data prepare sst2 --data_dir=.whl/tfds)
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
mkdir -p $root/all $out
uptime
for job in "$@"; do
  IFS='|' read -r name args <<< "$job"
  ( timeout -s TERM "$deadline" python3 experiments/bert_sst2/run.py --workdir=$root/$name \
      --manual_dir=$manual --data_dir=$tfds $args > $root/$name.log 2>&1
    echo "job $name exit $? at $(date -u +%T)" ) &
done
wait
uptime
for job in "$@"; do
  IFS='|' read -r name args <<< "$job"
  for arm in $root/$name/*/; do
    [ -e "$root/all/$(basename $arm)" ] || ln -s "${arm%/}" "$root/all/$(basename $arm)"
  done
done
if [ -n "$final_args" ]; then
  timeout -s TERM "$(( final_end > SECONDS + 10 ? final_end - SECONDS : 10 ))" python3 experiments/bert_sst2/run.py --workdir=$root/all \
      --manual_dir=$manual --data_dir=$tfds $final_args > $root/all.log 2>&1
  echo "final exit $? at $(date -u +%T)"
fi
python3 experiments/device_report.py $root
for f in $root/*.log; do echo "== tail $f"; grep -v "it/s\]" $f | tail -4; done
cd $root && tar czf $out/bert_device.tgz --exclude=checkpoints --exclude=tensorboard \
    . && ls -la $out
