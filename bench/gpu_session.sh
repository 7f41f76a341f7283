#!/usr/bin/env bash
# The GPU checks of one device session, on the lent machine (no network, torch 2.11+cu130 image),
# from the repo root. docs/gpu.md says how the wheel kit travels; this script is what each call runs:
#
#   bash bench/gpu_session.sh kit           # calls 1..9: carry .whl/cNN + .whl/MANIFEST.txt (exit 10 until all are in)
#   bash bench/gpu_session.sh check OUT     # last carry (+ .whl/x1): install, then `bench.gpu_check` (in-process vLLM)
#   bash bench/gpu_session.sh server OUT    # `bench.gpu_check --backend vllm_server` (the engine drives `vllm serve`)
#   bash bench/gpu_session.sh trace OUT     # `bench.trace_overhead` with every part on the GPU (TRACE_SEEDS pairs of
#                                           # TRACE_STEPS steps, default 2 x 30; the result is written after each run)
#
# With DRY=1 `check`/`server`/`trace` run anywhere: they resolve each GPU config (`--dry-run`) and start nothing.
set -u -o pipefail
step=${1:?usage: bash bench/gpu_session.sh kit|check|server [OUT]}
OUT=${2:-${OUT:-/tmp/streamrl-gpu-out}}
mkdir -p "$OUT"
export STREAMRL_CACHE=${STREAMRL_CACHE:-/tmp/streamrl-cache} WANDB_MODE=offline GLOO_SOCKET_IFNAME=lo \
    TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
PY=${PY:-python3}
DRY=${DRY:-0}

if [ "$DRY" != 1 ]; then
  bash bench/gpu_device_install.sh; rc=$?
  [ "$step" = kit ] && exit $rc
  [ $rc = 0 ] || { echo "[gpu] the kit is not installed (rc=$rc)"; exit $rc; }
  # vLLM's FlashAttention path imports tvm_ffi on this machine; it travels beside the kit (.whl/x1)
  if [ -d .whl/x1 ] && [ ! -d /tmp/site/tvm_ffi ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/x1/*.whl || exit 1
  fi
  . /tmp/kit/env.sh
  # the repo root is the `streamrl` package (pyproject's package-dir); Ray's workers inherit PYTHONPATH
  mkdir -p /tmp/py && ln -sfn "$PWD" /tmp/py/streamrl
  export PYTHONPATH=/tmp/py:$PYTHONPATH
  nvidia-smi -L
  $PY -c "import sys, torch, vllm, ray; print('python', sys.version.split()[0], 'torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
fi

# the GPU placement of bench/gpu_check.py with one GPU (engine and learner share it, gloo sync)
GPU=(
  rollout.engine.device=cuda rollout.engine.dtype=bfloat16 rollout.engine.num_gpus=0.5
  rollout.engine.gpu_memory_utilization=0.3 learner.device=cuda learner.num_workers=1
  learner.num_gpus_per_worker=0.5 weight_sync.backend=gloo
)
case $step in
  check) cmd=(-m bench.gpu_check --out "$OUT/gpu.json") ;;
  server) cmd=(-m bench.gpu_check --backend vllm_server --out "$OUT/gpu_server.json") ;;
  trace) cmd=(-m bench.trace_overhead --steps "${TRACE_STEPS:-30}" --seeds "${TRACE_SEEDS:-2}"
              --out "$OUT/trace_overhead_gpu.json" "${GPU[@]}") ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
if [ "$DRY" = 1 ]; then
  if [ "$step" = trace ]; then
    exec $PY -m streamrl.streaming.cli train --dry-run --config configs/bench_async_vs_sync.toml "${GPU[@]}"
  fi
  exec $PY "${cmd[@]}" --dry-run
fi
timeout "${CHECK_TIMEOUT_S:-300}" $PY "${cmd[@]}" > "$OUT/$step.log" 2>&1
rc=$?
echo "[gpu] $step rc=$rc"
tail -c 3000 "$OUT/$step.log"
exit $rc
