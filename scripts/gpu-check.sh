#!/usr/bin/env bash
# The checks that need a GPU, in one go, on a machine whose python already has torch with CUDA
# (and transformers): the gpu-marked tests, then benchmarks/families.py on CUDA (the families
# that fit this machine's GPUs), fp32 and bf16-mixed, at charlm's small size (the Python per
# step shows most) and at a larger one, then benchmarks/gpu_step.py (a GPT of 125 M and of 354 M
# parameters, bf16-mixed, compiled, fused AdamW: the Trainer against a hand-written loop, tokens/s,
# MFU, peak memory; its --json rows in $OUT). Output goes to stdout and, with OUT set, to $OUT/.
#   bash scripts/gpu-check.sh                  (make gpu-check does the same with the project's venv)
#   PARTS=gpu_step bash scripts/gpu-check.sh   (only some of: tests families gpu_step)
set -uo pipefail
PYTHON=${PYTHON:-python3}
PARTS=${PARTS:-tests families gpu_step}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
log=$out/gpu-check.log
{
  nvidia-smi -L || true
  "$PYTHON" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
  tests=0 bench=0 step=0
  if [[ " $PARTS " == *" tests "* ]]; then
    "$PYTHON" -m pytest -m gpu -p no:cacheprovider -q -ra --timeout 600 tests/gpu tests/strategies/data_parallel/test_dp.py tests/data/test_stream_pinned.py
    tests=$?
  fi
  if [[ " $PARTS " == *" families "* ]]; then
    for size in "--d-model 192 --layers 4 --batch 32 --block 64" "--d-model 768 --layers 8 --batch 64 --block 256"; do
      for precision in 32 bf16-mixed; do
        # shellcheck disable=SC2086
        "$PYTHON" benchmarks/families.py --accelerator cuda --precision "$precision" --families control single ddp $size --steps 50 --repeats 5 || bench=$?
      done
    done
  fi
  if [[ " $PARTS " == *" gpu_step "* ]]; then
    for size in 125m 350m; do  # bf16-mixed, Inductor, fused AdamW: the CUDA defaults of gpu_step.py
      "$PYTHON" benchmarks/gpu_step.py --size "$size" --device cuda --precision bf16-mixed --compile on --pairs 3 --steps 50 --warmup 10 --json "$out/gpu_step-$size.json" || step=$?
    done
  fi
  echo "gpu-check: tests exit $tests, benchmark exit $bench, gpu_step exit $step"
} 2>&1 | tee "$log"
