#!/usr/bin/env bash
# Everything shardscope checks on a GPU, in one command, for a machine lent for a few minutes.
#
#     OUT=/some/dir bash benchmarks/gpu_session.sh        # default OUT: ./gpu-out
#
# 1. the GPU-marked tests (CUDA step clock, gpu_check's table, ranks forked on CUDA);
# 2. when ONLY names gpu_check, benchmarks/gpu_check.py: every torch strategy, NCCL, CUDA memory against the model,
#    NVML, kernel traces, MFU (recorded once in RESULTS.md);
# 3. a smoke comparison with forked ranks (the default): which rank NVML's per-process readings were put down to;
#    benchmarks/startup.py --device cuda: start-up against the NCCL floor of a bare torchrun job, ranks forked (the
#    default) and exec'd;
# 4. shardscope predict on this GPU: calibrate on smoke, predict ddp-vs-fsdp at one rank from each run's probe, run
#    them, compare (benchmarks/predict_accuracy.py), and keep each run's records (no traces) in runs.tgz so that a
#    CPU calibration's `predict --device` what-if can be checked against them elsewhere.
# 5. when ONLY names them, the CPU benchmarks on this machine's idle cores (gloo; the 2-core CI VM is never quiet):
#    overhead (benchmarks/overhead.py) and cpu_predict (predict_accuracy.py over CPU_PRESETS at CPU_WORLD_SIZES).
# ONLY=tests,nvml,startup (say) runs those steps alone (names: env tests gpu_check nvml startup predict pack overhead
# cpu_predict). Each
# step has its own time limit; a step that fails leaves the next ones to run. Needs torch, click, rich, matplotlib,
# safetensors, psutil, nvidia-ml-py (not textual or DeepSpeed: their strategies are left out).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
W=$(mktemp -d)
# step NAME TITLE: say it and run it, unless ONLY names other steps (gpu_check runs only when named: done once, RESULTS.md)
step() {
  case ",${ONLY:-env,tests,nvml,startup,predict,pack}," in *",$1,"*) ;; *) return 1 ;; esac
  echo; echo "== $2 ($(date -u +%H:%M:%S))"
}

step env environment && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee "$OUT/env.txt"

step tests "GPU tests" && timeout 200 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_step_clock_cuda.py \
  tests/test_gpu_check.py tests/test_fork_cuda.py 2>&1 | tail -20 | tee "$OUT/gpu_tests.txt"

step gpu_check gpu_check && timeout 240 $PY benchmarks/gpu_check.py --world-size 1 --steps 12 --out "$W/gpu-check" 2>&1 \
  | tee "$OUT/gpu_check.txt"

# a forked rank's /proc shows no RANK (it names itself ssrank<R>): are NVML's per-process readings put down to it?
if step nvml "forked ranks: NVML per-process readings by rank"; then
  timeout 120 $PY -m shardscope.cli run --preset smoke --headless --set world_size=1 --set steps=400 \
    --out "$W/fork-nvml" > "$OUT/fork_nvml.log" 2>&1
  echo "smoke (default start method) exit $?"
  $PY - "$W/fork-nvml" <<'EOF' 2>&1 | tee "$OUT/fork_nvml.txt"
import collections, json, sys
from shardscope.core import events
out = sys.argv[1]
for run in ("ddp", "fsdp2"):
    start = events.read_records(f"{out}/{run}/metrics/rank0.jsonl")[0][0]
    print(run, "forked", start.get("forked"), "device", start.get("device"))
seen = collections.Counter()
for line in open(f"{out}/devices.jsonl", encoding="utf-8"):
    rec = json.loads(line)
    for r in rec["readings"]:
        seen[(rec["source"], r["kind"], r.get("run"), tuple(r.get("ranks") or ()))] += 1
for key, n in sorted(seen.items(), key=str):
    print(n, "readings:", key)
EOF
fi

# the default (ranks forked from the preloaded agent) against a new interpreter per rank
step startup start-up && timeout ${STARTUP_S:-200} $PY benchmarks/startup.py --device cuda --world-size 1 \
  --rounds ${ROUNDS:-2} --variants default,exec 2>&1 | tee "$OUT/startup.txt"

if step predict predict; then
  timeout 90 $PY -m shardscope.cli run --preset smoke --headless --set world_size=1 --out "$W/smoke" > "$OUT/smoke.log" 2>&1
  echo "smoke exit $?"
  timeout ${PREDICT_S:-200} $PY benchmarks/predict_accuracy.py --calibrate "$W/smoke" --world-sizes 1 \
    --presets ddp-vs-fsdp --probe --no-collectives --out "$W/predict" --json "$OUT/predict_accuracy.json" 2>&1 \
    | tee "$OUT/predict_accuracy.txt"
fi

# the instrumentation's cost and predict's error on CPU, on a machine with cores to spare for every rank
# CUDA_VISIBLE_DEVICES empty: shardscope sees no GPU, so presets run on CPU at their own world size (2 ranks, 4 for TP)
step overhead "overhead.py on CPU (gloo)" && CUDA_VISIBLE_DEVICES= timeout ${OVERHEAD_S:-200} $PY benchmarks/overhead.py \
  --pairs ${PAIRS:-400} 2>&1 | tee "$OUT/overhead.txt"

step cpu_predict "predict_accuracy.py on CPU (gloo)" && CUDA_VISIBLE_DEVICES= timeout ${CPU_PREDICT_S:-300} $PY benchmarks/predict_accuracy.py \
  --world-sizes ${CPU_WORLD_SIZES:-2} --presets ${CPU_PRESETS:-tp-verification} --probe --no-fresh \
  --repeats ${REPEATS:-1} --out "$W/cpu-predict" --json "$OUT/cpu_predict.json" 2>&1 | tee "$OUT/cpu_predict.txt"

step pack pack && tar czf "$OUT/runs.tgz" -C "$W" --exclude='*.pt.trace.json*' --exclude='*.json.gz' \
  --exclude='*.safetensors' --exclude='*.pickle' . && ls -la "$OUT"
true
