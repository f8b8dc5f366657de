#!/usr/bin/env bash
# Everything shardscope checks on a GPU, in one command, for a machine lent for a few minutes.
#
#     OUT=/some/dir bash benchmarks/gpu_session.sh        # default OUT: ./gpu-out
#
# 1. the GPU-marked tests (CUDA step clock, gpu_check's table, ranks forked on CUDA);
# 2. with GPU_CHECK=1, benchmarks/gpu_check.py: every torch strategy, NCCL, CUDA memory against the model, NVML,
#    kernel traces, MFU (recorded once in RESULTS.md);
# 3. benchmarks/startup.py --device cuda: start-up against the NCCL floor of a bare torchrun job, ranks exec'd (the
#    default on CUDA) and forked;
# 4. shardscope predict on this GPU: calibrate on smoke, predict ddp-vs-fsdp at one rank from each run's probe, run
#    them, compare (benchmarks/predict_accuracy.py), and keep each run's records (no traces) in runs.tgz so that a
#    CPU calibration's `predict --device` what-if can be checked against them elsewhere.
# Each step has its own time limit; a step that fails leaves the next ones to run. Needs torch, click, rich,
# matplotlib, safetensors, psutil, nvidia-ml-py (not textual or DeepSpeed: their strategies are left out).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
W=$(mktemp -d)
step() { echo; echo "== $1 ($(date -u +%H:%M:%S))"; }

step environment
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee "$OUT/env.txt"

step "GPU tests"
timeout 200 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_step_clock_cuda.py tests/test_gpu_check.py \
  tests/test_fork_cuda.py 2>&1 | tail -20 | tee "$OUT/gpu_tests.txt"

if [ -n "${GPU_CHECK:-}" ]; then  # done once (RESULTS.md, 2026-11-26); GPU_CHECK=1 runs it again (~4 min)
  step "gpu_check"
  timeout 240 $PY benchmarks/gpu_check.py --world-size 1 --steps 12 --out "$W/gpu-check" 2>&1 | tee "$OUT/gpu_check.txt"
fi

step "start-up"  # default = exec on CUDA, against ranks forked from the preloaded agent
timeout ${STARTUP_S:-200} $PY benchmarks/startup.py --device cuda --world-size 1 --rounds ${ROUNDS:-2} --variants default,fork \
  2>&1 | tee "$OUT/startup.txt"

step "predict"
timeout 90 $PY -m shardscope.cli run --preset smoke --headless --set world_size=1 --out "$W/smoke" > "$OUT/smoke.log" 2>&1
echo "smoke exit $?"
timeout ${PREDICT_S:-200} $PY benchmarks/predict_accuracy.py --calibrate "$W/smoke" --world-sizes 1 --presets ddp-vs-fsdp \
  --probe --no-collectives --out "$W/predict" --json "$OUT/predict_accuracy.json" 2>&1 | tee "$OUT/predict_accuracy.txt"

step "pack"
tar czf "$OUT/runs.tgz" -C "$W" --exclude='*.pt.trace.json*' --exclude='*.json.gz' --exclude='*.safetensors' \
  --exclude='*.pickle' . && ls -la "$OUT"
