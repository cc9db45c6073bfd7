#!/usr/bin/env bash
# The GPU-machine runner: runs the named parts in order with the system python3 and src/ on
# PYTHONPATH (no venv, no registry needed) and leaves what they produce under $OUT.
#
#   WSATTN_COMMIT=<sha> bash scripts/device.sh PART...
#
# Parts (files under $OUT; the whole console output also goes to device.log):
#   tests   every GPU-marked test in tests/ on one GPU ("gpu or sm90", not multi_gpu) -> gpu_tests.log
#   ladder  the sm_90 evidence ladder, every library kernel, top gate
#           -> ladder_sm90.json (rewritten after each kernel), ladder_sm90.md, ladder_sm90.png
#   bench   `wsattn bench` with ceilings and peers -> bench.json, bench.png
#   host    host time of one eager decode / varlen call, default and validate=True
#           (python3 -m wsattn.bench.host) -> host.json
#   power   each bench column alone for seconds, its SM clock, power and energy a call
#           (python3 -m wsattn.bench.power $POWER_ARGS) -> power.json, power_clocks.csv
#   sp      sp-tests then sp-bench, over every visible GPU (two or more)
#   sp-tests  the NCCL battery, tests/test_sp_nccl.py -> sp_tests.log
#   sp-bench  torchrun -m wsattn.sp.bench, one process per GPU -> sp_bench_w<GPUs>.json
#   ncu     Nsight Compute, --set full, of one prefill launch per implementation
#           (python3 -m wsattn.bench.ncu_target) -> ncu_<impl>_<args>.txt (+ _sass.csv.gz)
#
# Settings (environment):
#   OUT            where results go (the device tool sets it; default ./device-out)
#   WSATTN_COMMIT  the commit the rows are stamped with; always set it (also for a direct
#                  `wsattn bench` call there): the device copy's git metadata, where it has
#                  any, need not be this tree's (one such call was stamped with an
#                  earlier commit plus -dirty)
#   BENCH_ARGS     arguments of `wsattn bench` (default "all"; e.g. "decode --quick"), or
#                  several runs separated by ';' ("step --batch 1; varlen; moe"), each with
#                  its own BENCH_S limit and files bench_<n>_<kind>.{json,png}
#   BENCH_BASE     a folder holding an earlier commit's src/ (written by
#                  `scripts/ab_base.sh REV`, which also records REV in it; carry it: it is
#                  ignored by git): each bench run first runs with that src/ in place of
#                  this tree's, stamped with REV, into bench[_<n>_<kind>]_base.json (no
#                  plot), then as usual: the "before" column of a change, two processes
#                  back to back on one GPU, each measuring its own copy ceiling; then
#                  `python3 -m wsattn.bench.compare` of the two sides -> ..._compare.json
#   BENCH_ROUNDS   with BENCH_BASE: this many base / new process pairs a run, alternating
#                  (default 1), files ..._base_r<i>.json / ..._r<i>.json, the plot of the
#                  last; the comparison calls a row faster or slower only when the two
#                  sides' ranges over the rounds do not overlap (one pair cannot tell a few
#                  percent from the spread between processes; the table's "chance" column
#                  is how often that happens with no change: 10 % a row at 3 rounds)
#   BENCH_COMPARE_METRICS  with BENCH_BASE: more row fields to compare besides median_ms,
#                  each into ..._compare_<metric>.json (e.g. "ratio_contiguous" for
#                  chunked: a time against its peer column's in the same process, which
#                  cancels the drift between processes)
#   CLOCKS         1: log the GPU's SM / memory clocks, power draw and limit, temperature and
#                  active clock-event (throttle) reasons every CLOCKS_MS ms (default 20)
#                  while the parts run -> clocks.csv (nvidia-smi's host timestamps; bench
#                  rows carry samples_t, the host time after each sample, to align with it:
#                  `python3 -m wsattn.bench.clocks bench.json clocks.csv`)
#   PEERS          1: before the parts, install the peer wheels (FlashAttention-4 AOT,
#                  FlashInfer, tvm-ffi) into .peers-site, put it on PYTHONPATH and set
#                  FLASHINFER_DISABLE_JIT=1, so that the bench (and tests) parts run the
#                  peers; without it their bench rows say 'not available' and their GPU
#                  tests skip. The wheels are read from .peers-wheels/ (ignored by git):
#                  `../shared` beside the checkout does not travel with a device call, so
#                  copy them there first and carry the folder:
#                    mkdir -p .peers-wheels && cp ../shared/peers/*.whl .peers-wheels/
#                    (device call with carry [".peers-wheels"]; 36 MB of the 64 MiB)
#                  ../shared/peers is used where it does exist on the device.
#   TEST_PATHS     test files or folders of the tests part (default tests/)
#   TEST_K         a pytest -k expression narrowing the tests part (default: none)
#   TEST_WORKERS   N: the tests part over N pytest-xdist processes on the one GPU, the files
#                  in TEST_SERIAL (default tests/test_step_gpu.py) one at a time beside them
#                  -> gpu_tests.log, gpu_tests_serial.log. The whole GPU suite (728 tests)
#                  took 9 minutes this way with N = 8 and PEERS=1
#   LADDER_ARGS    extra ladder arguments (default "--stress-launches 2000"; kernels by name)
#   POWER_ARGS     arguments of the power part (e.g. "--impl wsattn fa4 sdpa-cudnn
#                  --prefill-seqlens 4096 16384 --prefill-dims 128"; with PEERS=1 for fa4)
#   SP_ARGS        arguments of the SP bench (e.g. "--sp-what prefill --sp-seqlens 16384 65536")
#   NCU_IMPLS      implementations to profile (default "gluon cudnn"), NCU_ARGS their shape
#                  (default "--n 4096 --d 128"), SOURCE=1 adds per-SASS counters; a
#                  column of the chunked bench as chunked:COLUMN, e.g. NCU_IMPLS="chunked:gluon-paged
#                  chunked:gluon-contiguous" NCU_ARGS="--d 64 --prefix 0 --page 64"
#   <PART>_S       time limit of a part in seconds (TESTS_S, LADDER_S, BENCH_S, HOST_S, POWER_S,
#                  SP_TESTS_S, SP_BENCH_S, NCU_S per implementation)
#
# A part that fails or runs out of time is reported and the next one runs; the exit status
# is 0 only when every part passed. The device tool brings back at most 8 files: after
# every part (and every bench run), once more than 7 files sit beside device.log they are
# added to results.tar.gz, so a call cut off by the tool's limit still returns what
# finished.
#
# Rough durations on one H200: tests more than 7 min for all of tests/ (split them with
# TEST_PATHS: decode/gemv/inputs/integration/paged/runner files alone take ~5 min), ladder 6.5 min (8 kernels, 2,000 stress
# launches each), bench 2 min, host 1 min, sp-tests 2 min, sp-bench up to 9 min (every
# shape; SP_ARGS picks fewer), ncu 1-2 min an implementation. One call runs at most 10
# minutes, so e.g. "tests host bench" is one call and "ladder" another. Nsight Compute
# reads the hardware counters on the Firecracker kinds (nvidia-h200-x2 and larger), not on
# the single-GPU kind; it runs with --clock-control none (clocks as in the benchmarks).
#
# Beside it, tools for kernel work (same environment, run by hand):
#   scripts/device_gluon.py         Gluon prefill settings variants: numerics, stress, timing
#                                   side by side with cuDNN and the Triton kernel
#   scripts/device_prefill_sweep.py the Triton prefill's launch-settings sweep
#   scripts/device_moe_small_kernels.py  the MoE router's top-k and grouping kernels at
#                                   1 / 2 / 4 / 8 warps, checked against the default
#   scripts/device_fill_probe.py    the one-token MoE gate/up against its expert count, and
#                                   the kernels cuBLAS runs at the step's 1-64-row shapes
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
PARTS=()
for p in "$@"; do
  case "$p" in
    tests|ladder|bench|host|power|sp-tests|sp-bench|ncu) PARTS+=("$p") ;;
    sp) PARTS+=(sp-tests sp-bench) ;;
    -h|--help) usage; exit 0 ;;
    *) echo "device.sh: unknown part '$p'" >&2; usage >&2; exit 2 ;;
  esac
done
[ ${#PARTS[@]} -gt 0 ] || { usage >&2; exit 2; }

OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast stays off on the lent machines: a program using it can take the host's
# GPUs out of service. Exported here so that every child (torchrun's too) inherits it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

run_part() {  # run_part NAME SECONDS COMMAND...: the part's status, a timeout named as such
  local name=$1 limit=$2; shift 2
  echo "device: == $name (limit ${limit} s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  if [ "$rc" -eq 124 ]; then
    echo "device: $name ran out of its ${limit} s" >&2
  fi
  echo "device: $name rc=$rc in $((SECONDS - t0)) s"
  return "$rc"
}

setup_peers() {  # PEERS=1: the peer wheels, installed as ../shared/peers/README.md says
  local wheels=(.peers-wheels/*.whl)
  [ -e "${wheels[0]}" ] || wheels=(../shared/peers/*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    echo "device: PEERS=1 but neither .peers-wheels/ (carried) nor ../shared/peers holds wheels" \
         "(.. has: $(ls .. | tr '\n' ' '))" >&2
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target .peers-site "${wheels[@]}" || { echo "device: installing the peer wheels failed" >&2; return 1; }
  export PYTHONPATH="$PWD/.peers-site:$PYTHONPATH" FLASHINFER_DISABLE_JIT=1
  echo "device: peers in .peers-site: $(ls .peers-site | grep -v dist-info | tr '\n' ' ')"
}

ngpus() { python3 -c 'import torch; print(torch.cuda.device_count())'; }

part_tests() {
  # -v names each test's result as it finishes: a part cut off by its limit (pytest killed
  # before its summary) still shows which tests failed
  local args=(-v -p no:cacheprovider -rfEs --tb=short --timeout "${TEST_TIMEOUT_S:-300}"
              -m "(gpu or sm90) and not multi_gpu" ${TEST_K:+-k "$TEST_K"})
  if [ -z "${TEST_WORKERS:-}" ]; then
    run_part tests "${TESTS_S:-540}" python3 -m pytest "${args[@]}" ${TEST_PATHS:-tests/} \
      > "$OUT/gpu_tests.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/gpu_tests.log"
    return "$rc"
  fi
  # TEST_WORKERS=N: pytest-xdist (on the device image) spreads the tests over N processes
  # sharing the GPU, which mostly parallelises Triton's compiles; the files in TEST_SERIAL
  # (whole-model tests, up to ~64 GB of GPU memory each) run one at a time beside them
  local serial=${TEST_SERIAL:-tests/test_step_gpu.py} ignore=() paths=() f
  for f in $serial; do ignore+=(--ignore="$f"); done
  for f in ${TEST_PATHS:-tests/}; do  # a serial file named here too runs only serially
    case " $serial " in *" $f "*) ;; *) paths+=("$f") ;; esac
  done
  [ "${#paths[@]}" -gt 0 ] || { echo "device: TEST_PATHS holds only TEST_SERIAL files; unset TEST_WORKERS" >&2; return 2; }
  run_part tests-serial "${TESTS_S:-540}" python3 -m pytest "${args[@]}" $serial \
    > "$OUT/gpu_tests_serial.log" 2>&1 &
  local serial_pid=$!
  run_part tests "${TESTS_S:-540}" python3 -m pytest "${args[@]}" -n "$TEST_WORKERS" \
    --dist load "${ignore[@]}" "${paths[@]}" > "$OUT/gpu_tests.log" 2>&1
  local rc=$?
  wait "$serial_pid" || rc=1
  tail -n 25 "$OUT/gpu_tests.log"
  tail -n 15 "$OUT/gpu_tests_serial.log"
  return "$rc"
}

part_ladder() {
  # shellcheck disable=SC2086  # LADDER_ARGS is a list of words
  run_part ladder "${LADDER_S:-580}" python3 -m wsattn.cli ladder --target sm_90 \
    --json "$OUT/ladder_sm90.json" --markdown "$OUT/ladder_sm90.md" \
    ${LADDER_ARGS:---stress-launches 2000}
}

part_bench() {
  # BENCH_ARGS may hold several runs separated by ';' ("step --batch 1; varlen; moe"):
  # each gets its own limit (BENCH_S) and files bench_<n>_<kind>.{json,png}; one run keeps
  # the names bench.json / bench.png. A run that fails or times out does not stop the next.
  local runs=() args kind json n=0 rc=0
  IFS=';' read -ra runs <<< "${BENCH_ARGS:-all}"
  for args in "${runs[@]}"; do
    read -ra words <<< "$args"
    [ ${#words[@]} -gt 0 ] || continue
    n=$((n + 1)); kind=${words[0]}
    json="$OUT/bench.json"
    [ ${#runs[@]} -gt 1 ] && json="$OUT/bench_${n}_${kind}.json"
    local rounds=1 r sfx plot bases=() news=()
    if [ -n "${BENCH_BASE:-}" ]; then
      [ -d "$BENCH_BASE/src/wsattn" ] || { echo "device: BENCH_BASE=$BENCH_BASE holds no src/wsattn" >&2; return 1; }
      rounds=${BENCH_ROUNDS:-1}
      [[ "$rounds" =~ ^[1-9][0-9]*$ ]] \
        || { echo "device: BENCH_ROUNDS must be a positive integer, got '$rounds'" >&2; return 1; }
    fi
    for ((r = 1; r <= rounds; r++)); do
      sfx=""
      [ "$rounds" -gt 1 ] && sfx="_r$r"
      if [ -n "${BENCH_BASE:-}" ]; then
        PYTHONPATH="${PYTHONPATH//$PWD\/src/$(cd "$BENCH_BASE" && pwd)/src}" \
        WSATTN_COMMIT="$(cat "$BENCH_BASE/COMMIT" 2>/dev/null || echo "base of ${WSATTN_COMMIT:-unknown}")" \
          run_part "bench $kind (base$sfx)" "${BENCH_S:-300}" python3 -m wsattn.cli bench \
          --json "${json%.json}_base$sfx.json" --no-plot "${words[@]}" || rc=1
        [ -f "${json%.json}_base$sfx.json" ] && bases+=("${json%.json}_base$sfx.json")
      fi
      plot=(--no-plot)
      [ "$r" -eq "$rounds" ] && plot=(--plot "${json%.json}.png")
      run_part "bench $kind$sfx" "${BENCH_S:-300}" python3 -m wsattn.cli bench \
        --json "${json%.json}$sfx.json" "${plot[@]}" "${words[@]}" || rc=1
      [ -f "${json%.json}$sfx.json" ] && news+=("${json%.json}$sfx.json")
    done
    # the files each side wrote (a process cut off by its limit may leave none)
    if [ ${#bases[@]} -gt 0 ] && [ ${#news[@]} -gt 0 ]; then
      for metric in median_ms ${BENCH_COMPARE_METRICS:-}; do
        sfx=""
        [ "$metric" = median_ms ] || sfx="_$metric"
        run_part "compare $kind${sfx/_/ }" 60 python3 -m wsattn.bench.compare \
          --base "${bases[@]}" --new "${news[@]}" --metric "$metric" \
          --json "${json%.json}_compare$sfx.json" || rc=1
      done
    fi
    pack_results
  done
  return "$rc"
}

part_host() {
  run_part host "${HOST_S:-180}" python3 -m wsattn.bench.host --json "$OUT/host.json"
}

part_power() {  # POWER_ARGS: arguments of python3 -m wsattn.bench.power
  local args; read -ra args <<< "${POWER_ARGS:-}"
  run_part power "${POWER_S:-300}" python3 -m wsattn.bench.power "${args[@]}" \
    --json "$OUT/power.json" --log "$OUT/power_clocks.csv"
}

part_sp-tests() {
  local n; n=$(ngpus)
  [ "$n" -ge 2 ] || { echo "device: sp-tests needs two or more GPUs, found $n" >&2; return 1; }
  run_part sp-tests "${SP_TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -rf \
    --timeout "${SP_TESTS_S:-300}" -m multi_gpu tests/test_sp_nccl.py > "$OUT/sp_tests.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/sp_tests.log"
  return "$rc"
}

part_sp-bench() {
  local n; n=$(ngpus)
  [ "$n" -ge 2 ] || { echo "device: sp-bench needs two or more GPUs, found $n" >&2; return 1; }
  # shellcheck disable=SC2086
  run_part sp-bench "${SP_BENCH_S:-540}" python3 -m torch.distributed.run --standalone \
    --nproc-per-node "$n" -m wsattn.sp.bench --json "$OUT/sp_bench_w$n.json" ${SP_ARGS:-}
}

part_ncu() {
  local rep=${NCU_REP:-/tmp/ncu-rep} status=0 impl tag
  mkdir -p "$rep"
  local args=${NCU_ARGS:---n 4096 --d 128}
  for impl in ${NCU_IMPLS:-gluon cudnn}; do
    tag=$(echo "$impl $args" | tr -c 'a-zA-Z0-9\n' '_' | tr -s '_' | sed 's/^_//; s/_$//')
    # shellcheck disable=SC2086
    run_part "ncu $impl" "${NCU_S:-300}" ncu --clock-control none --nvtx --nvtx-include "prof/" \
      --set full --import-source no -f -o "$rep/$tag" \
      python3 -m wsattn.bench.ncu_target "$impl" $args > "$OUT/ncu_$tag.txt" 2>&1 || status=1
    ncu -i "$rep/$tag.ncu-rep" --page details --print-units base >> "$OUT/ncu_$tag.txt" 2>&1 \
      || status=1
    if [ -n "${SOURCE:-}" ]; then
      ncu -i "$rep/$tag.ncu-rep" --page source --csv --print-source sass 2>&1 \
        | gzip > "$OUT/ncu_${tag}_sass.csv.gz"
    fi
  done
  return "$status"
}

start_clock_log() {  # CLOCKS=1: nvidia-smi in the background; its pid in $!
  local reasons=clocks_event_reasons.active
  # the older name of the field, where the driver does not know the newer one
  nvidia-smi --query-gpu="$reasons" --format=csv,noheader > /dev/null 2>&1 \
    || reasons=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,$reasons \
    --format=csv -lms "${CLOCKS_MS:-20}" > "$OUT/clocks.csv" 2>&1 &
  echo "device: logging clocks every ${CLOCKS_MS:-20} ms into $OUT/clocks.csv"
}

pack_results() {
  # The device tool returns at most 8 files. Once more than 7 sit beside device.log, they
  # go into results.tar.gz (added to what it already holds), after every part, so a call
  # stopped by the tool's time limit still returns everything finished before it.
  local files=()
  # (the clock log stays out while nvidia-smi still writes it: packing removes the file)
  mapfile -t files < <(cd "$OUT" && find . -type f ! -name device.log ! -name results.tar.gz \
                         ${CLOCK_LOGGER:+! -name clocks.csv} | sort)
  local have=0
  [ -f "$OUT/results.tar.gz" ] && have=1
  [ $(( ${#files[@]} + have + 1 )) -gt 8 ] || return 0
  (cd "$OUT" && { [ "$have" = 0 ] || gunzip -f results.tar.gz; } \
     && tar rf results.tar "${files[@]}" && gzip -f results.tar && rm -f "${files[@]}") \
    && echo "device: ${#files[@]} more result files packed into $OUT/results.tar.gz"
}

main() {
  echo "device: parts ${PARTS[*]}; results in $OUT"
  echo "device: commit ${WSATTN_COMMIT:-unset (set WSATTN_COMMIT: the rows say 'unknown' without .git)}"
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
'cudnn', torch.backends.cudnn.version(), 'gpus', torch.cuda.device_count())"
  local failed=() logger=""
  if [ "${PEERS:-}" = 1 ]; then
    setup_peers || failed+=(peers)
  fi
  if [ "${CLOCKS:-}" = 1 ]; then
    start_clock_log && logger=$! && CLOCK_LOGGER=$logger
  fi
  for p in "${PARTS[@]}"; do
    "part_$p" || failed+=("$p")
    pack_results
  done
  if [ -n "$logger" ]; then
    kill "$logger" 2>/dev/null
    CLOCK_LOGGER=""
  fi
  if [ ${#failed[@]} -eq 0 ]; then
    echo "device: all parts passed"
  else
    echo "device: FAILED: ${failed[*]}"
    return 1
  fi
}

main 2>&1 | tee "$OUT/device.log"
status=${PIPESTATUS[0]}

pack_results
exit "$status"
