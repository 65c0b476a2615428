#!/usr/bin/env bash
# On the GPU machine after device_train.sh: end-to-end tables (bf16) with HF beside specdec.
set -uo pipefail
. /tmp/stage/env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p specdec/drafters/checkpoints "$OUT"
[ -d out/ckpt ] && cp -r out/ckpt/* specdec/drafters/checkpoints/
# 1) batch 1, HF beside specdec, 16 held-out problems (HF greedy is ~20 tokens/s here)
python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-115 --max-new-tokens 128 \
  --drafters null,suffix,dflash,dspark --out "$OUT/e2e_gpu_b1" 2>&1 | tail -12
# 2) acceptance on all held-out problems, batch 16, 256 new tokens (specdec only)
python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 --batch-size 16 \
  --skip-hf --drafters null,suffix,dflash,dspark --out "$OUT/e2e_gpu_b16" 2>&1 | tail -10
