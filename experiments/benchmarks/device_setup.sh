# Sourced by gpu_device.sh and cpu_device.sh on a lent device machine (the device tool): installs
# the carried wheels of attnlab's dependencies that the device image lacks (.whl/, listed in
# gpu_device.sh's header) into /tmp/site, puts them and this checkout on PYTHONPATH, and sets
# $nanogpt (nanoGPT's export, copied into .whl/nanogpt, since ../shared does not travel), $OUT
# and $smoke. LOCAL_CHECK=1 (a check of the scripts on this machine) installs nothing, reads
# nanoGPT from ../shared/anchors/nanogpt and sets smoke=--smoke.
OUT=${OUT:-/tmp/device_out}; mkdir -p "$OUT"
smoke=""
if [ -n "${LOCAL_CHECK:-}" ]; then
  smoke="--smoke"; nanogpt=$PWD/../shared/anchors/nanogpt
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  # The carried flax/optax/orbax are the versions tested here; where they do not import beside
  # the device's jax, the device's own are used.
  if ! python3 -c "import attnlab.tasks, attnlab.checkpoint" 2>"$OUT/import.txt"; then
    tail -3 "$OUT/import.txt"; echo "carried flax/optax/orbax left out"
    rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --target /tmp/site $(ls .whl/*.whl | grep -vE "/(flax|optax|orbax)") || exit 1
  fi
  nanogpt=$PWD/.whl/nanogpt
fi
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: the command's output in $OUT/NAME.txt, its tail shown
  # (SIGNAL=INT: pytest prints its summary on it); timeout ends the step's whole process group.
  # SECONDS 0 skips the step.
  local name=$1 secs=$2; shift 2
  if [ "$secs" -le 0 ]; then echo "== $name skipped"; return; fi
  echo "== $name (deadline ${secs} s) $(date -u +%T)"
  timeout -s "${SIGNAL:-TERM}" -k 10 "$secs" "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name exit $? $(date -u +%T)"
  grep -v "^  round" "$OUT/$name.txt" | tail -40
}
