#!/usr/bin/env bash
# The prepared GPU run: every CUDA check of issue 37 in one time-boxed call, each result one JSON line.
#
#   bash benchmarks/gpu/run.sh --device cuda --out "$OUT"     # on the GPU machine (at most 7.5 minutes)
#   bash benchmarks/gpu/run.sh --device cpu --out /tmp/gpu    # the dry run here (tiny sizes, seconds)
#
# Steps (each under `timeout`, each its own log; a step that fails or times out is recorded and the
# run goes on, since the device time allows one rerun at most):
#   1 correctness   the core test modules with PHALANX_TEST_DEVICE=cuda (phalanx.testing.device)
#   2 overhead      DataParallel and hvd.DistributedOptimizer vs DDP, NCCL world of one, bf16
#   3 amp           fp16 + GradScaler with a forced inf, bf16: 2 gloo ranks vs torch.amp + DDP
#   4 codecs        compress + decompress GB/s of every compressor vs a device copy, 100 MB
#   5 zero_memory   max_memory_allocated per rank, ZeRO 1-3 vs the formula and FSDP2
#   6 overlap       a profiler trace: does a bucket's collective overlap later backward kernels?
#   7 launcher      `phalanx run` on a one-GPU machine: NCCL on cuda:0, two NCCL ranks refused in one
#                   line, two gloo ranks sharing the GPU
#   8 variants      what compiling cannot fuse (top-k, threshold, PowerSGD orthogonalisation) timed alone
#   9 codec_profile where a codec's round trip goes: device kernel time vs wall, top ops, top Python
#  10 fused_add     error feedback's add fused or as its own pass: a paired, interleaved A/B per codec
#  11 titan_step    a Llama 3 8B step (1 and 3 blocks) as torchtitan runs it, profiled, against the planner
# Steps 1, 3, 5, 6 and 7 measure no time, so the others run beside the tests; 2, 4, 8, 9, 10 and 11 time
# kernels and run alone afterwards (after the tests, which have filled TorchInductor's cache of
# the codecs' compiled kernels).
#
# Output under --out: results.jsonl (every JSON line; committed as benchmarks/results/gpu-*.jsonl)
# and logs.tar.gz (each step's log, the JUnit file, the profiler traces).
set -u
cd "$(dirname "$0")/../.."
DEVICE=cuda
OUT_DIR=${OUT:-/tmp/phalanx-gpu}
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --out) OUT_DIR=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;   # comma list of step names, for a rerun of what failed
    *) echo "run.sh: unknown argument $1; accepted: --device cpu|cuda, --out DIR, --only step,step" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cpu|cuda) ;; *) echo "run.sh: --device $DEVICE; accepted: cpu | cuda" >&2; exit 2 ;; esac
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d)
RESULTS="$OUT_DIR/results.jsonl"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}

wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

# step NAME SECONDS CMD...: run CMD under a time box, its output in $WORK/NAME.log, a JSON line for its end
step() {
  local name=$1 secs=$2; shift 2
  wanted "$name" || return 0
  local t0=$SECONDS
  timeout -k 15 "$secs" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  printf '{"step": "run", "name": "%s", "device_kind": "%s", "rc": %d, "timed_out": %s, "seconds": %d, "limit_s": %d}\n' \
    "$name" "$DEVICE" "$rc" "$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo true || echo false)" \
    "$((SECONDS - t0))" "$secs" | tee -a "$RESULTS"
  tail -n 5 "$WORK/$name.log" | sed "s/^/  [$name] /"
}

if [ "$DEVICE" = cuda ]; then
  T_TESTS=${T_TESTS:-300} T_OVERHEAD=100 T_AMP=60 T_CODECS=240 T_ZERO=110 T_OVERLAP=60 T_LAUNCHER=80
  ZERO_ARGS="--timeout 40 --max-seconds 75"
  TESTS="tests/comm/test_collectives.py tests/parallel/test_data_parallel.py tests/parallel/test_zero.py \
tests/comm/test_compression.py tests/comm/test_compressed_collectives.py tests/services/test_checkpoint.py"
  XDIST="-n 6"
else  # the dry run: one small test module stands for the correctness step
  T_TESTS=120 T_OVERHEAD=120 T_AMP=120 T_CODECS=60 T_ZERO=120 T_OVERLAP=90 T_LAUNCHER=80
  ZERO_ARGS="--configs zero1,zero3,fsdp2"  # the dry run: each code path once (stage 2 is stage 1's path)
  TESTS="tests/comm/test_collectives.py -k np2-sum"  # one spawned world, one check
  XDIST="-n 0"
fi
TESTS=${GPU_TESTS:-$TESTS}  # a rerun of some test modules alone: GPU_TESTS="tests/comm/test_compression.py ..."

# 0: what machine this is
$PY - "$DEVICE" <<'PYEOF' | tee -a "$RESULTS"
import json, os, subprocess, sys, platform, torch
info = {"step": "machine", "device_kind": sys.argv[1], "torch": torch.__version__, "python": platform.python_version(),
        "cpus": os.cpu_count(), "cuda": torch.version.cuda}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
    info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        info["driver"] = repr(exc)
print(json.dumps(info))
PYEOF

J="--device $DEVICE --out $RESULTS"
# 1 with 3, 5, 6 beside it (none of them is timed)
(
  if wanted correctness; then
    # shellcheck disable=SC2086
    step correctness "$T_TESTS" env PHALANX_TEST_DEVICE="$DEVICE" $PY -m pytest -q $XDIST --dist loadfile \
      -p no:cacheprovider --timeout 250 --junitxml "$WORK/junit.xml" -o addopts="" $TESTS
    $PY benchmarks/gpu/junit_summary.py "$WORK/junit.xml" $J >/dev/null
  fi
  # the dry run: the launcher check after the one-test correctness step, so that the three chains of
  # steps take about as long (amp -> zero_memory -> overlap -> launcher was the longest, ~80 of 85 s)
  if [ "$DEVICE" = cpu ]; then step launcher "$T_LAUNCHER" $PY benchmarks/gpu/launcher_check.py $J; fi
) &

timed_steps() {
  step overhead "$T_OVERHEAD" $PY benchmarks/gpu/overhead.py $J
  step codecs "$T_CODECS" $PY benchmarks/gpu/codecs.py $J
  step variants 120 $PY benchmarks/gpu/variants.py $J
  # on the CPU: the codecs' CUDA path, run eagerly (its host ops counted; on CUDA it is the default)
  # shellcheck disable=SC2046
  step codec_profile 120 $PY benchmarks/gpu/codec_profile.py $J $([ "$DEVICE" = cpu ] && echo --fused)
  step fused_add 120 $PY benchmarks/gpu/fused_add_ab.py $J
  # a real Llama 3 8B step (truncated) as torchtitan runs it, against the planner's price (issue 42)
  # shellcheck disable=SC2046
  step titan_step 240 $PY benchmarks/gpu/titan_step.py $J --profile --trace-dir "$WORK" \
    $([ "$DEVICE" = cuda ] && echo --compile || echo --steps 1 --warmup 1)
}
# the dry run times nothing: its timed steps run beside the rest, so that its test stays short
if [ "$DEVICE" = cpu ]; then timed_steps & fi
step amp "$T_AMP" $PY benchmarks/gpu/amp.py $J
step zero_memory "$T_ZERO" $PY benchmarks/gpu/zero_memory.py $J $ZERO_ARGS
step overlap "$T_OVERLAP" $PY benchmarks/gpu/overlap.py $J --trace-dir "$WORK"
if [ "$DEVICE" = cuda ]; then step launcher "$T_LAUNCHER" $PY benchmarks/gpu/launcher_check.py $J; fi
wait
if [ "$DEVICE" = cuda ]; then timed_steps; fi  # 2, 4, 8, 9, 10 and 11 alone: they time kernels

tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" . 2>/dev/null
rm -rf "$WORK"
echo "run.sh: results in $RESULTS, logs in $OUT_DIR/logs.tar.gz"
