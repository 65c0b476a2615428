#!/usr/bin/env bash
# On the GPU machine (after the staging calls): train the shipped DFlash and DSpark drafters
# for SmolLM2-135M by self-distillation, bf16 (the settings of the shipped checkpoints). Writes checkpoints to out/ckpt and $OUT.
set -euo pipefail
. /tmp/stage/env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p out "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python -m specdec.cli train-drafter --kind both --out out/ckpt --device cuda --dtype bfloat16 \
  --num-text-prompts 1400 --max-new-tokens 256 --batch-size 128 --block-size 8 --num-layers 2 \
  --num-target-layers 3 --steps 6000 --max-seconds "${TRAIN_SECONDS:-80}" --lr 1e-3 \
  --seqs-per-step 16 --anchors 32 --data out/distill.pt 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -40 | tee "$OUT/train.log"
cp -r out/ckpt "$OUT/"
