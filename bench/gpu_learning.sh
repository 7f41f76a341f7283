#!/usr/bin/env bash
# The learning benchmark at GPU size, on a machine with CUDA and the GPU extra importable (on the
# lent device machine: the wheel kit installed into /tmp/site first). It runs `bench.learning` on
# configs/learning_smollm2.toml with every part on the one GPU: the vLLM CUDA engine in bf16, the
# learner on CUDA, gloo weight sync (NCCL refuses two processes on one GPU), with a GPU-sized batch
# (4 prompts x 8 samples a step), 256 held-out prompts and the calculator answering at once.
#
#   bash bench/gpu_learning.sh OUT_DIR [--dry-run]
#
# --dry-run resolves the GPU config (`streamrl train --dry-run`) and starts nothing: it runs anywhere.
set -u -o pipefail
OUT=${1:?usage: bash bench/gpu_learning.sh OUT_DIR [--dry-run]}
mkdir -p "$OUT"
export STREAMRL_CACHE=${STREAMRL_CACHE:-/tmp/streamrl-cache} WANDB_MODE=offline GLOO_SOCKET_IFNAME=lo \
    TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
PY=${PY:-python3}
GPU=(
  rollout.engine.device=cuda rollout.engine.dtype=bfloat16 rollout.engine.num_gpus=0.5
  rollout.engine.gpu_memory_utilization=0.3 learner.device=cuda learner.num_workers=1
  learner.num_gpus_per_worker=0.5 weight_sync.backend=gloo
  buffer.batch_size=32 buffer.group_size=8 rollout.max_concurrent_per_worker=64
  learner.micro_batch_tokens=8192 learner.gradient_checkpointing=false
  eval.num_prompts=256 rollout.agent.tool_config=configs/tools/calculator.yaml
)
if [ "${2:-}" = "--dry-run" ]; then
  exec $PY -m streamrl.streaming.cli train --dry-run --config configs/learning_smollm2.toml "${GPU[@]}"
fi
$PY -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'vllm', vllm.__version__)"
timeout "${LEARN_TIMEOUT_S:-420}" $PY -m bench.learning --seeds 0 --modes async sync --steps 8 --eval-every 4 \
    --out "$OUT/learning_gpu.json" --keep /tmp/streamrl-learning-gpu "${GPU[@]}" > "$OUT/learning_gpu.log" 2>&1
rc=$?
echo "bench.learning rc=$rc"
tail -5 "$OUT/learning_gpu.log"
for run in /tmp/streamrl-learning-gpu/*/; do  # what the runs measured, for the record
  name=$(basename "$run")
  cp "$run/metrics.jsonl" "$OUT/$name-metrics.jsonl" 2>/dev/null
  tail -c 20000 "$run/logs/driver.log" > "$OUT/$name-driver.log" 2>/dev/null
done
exit $rc
