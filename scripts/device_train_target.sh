#!/usr/bin/env bash
# Train the bundled target on the lent GPU machine (see ../.library/device), in one call.
#
# Here, first:   make setup && .venv/bin/python -m training.pretrain --preset target --out /tmp/x --tokens 1 \
#                  && mkdir -p build/corpus && cp ~/.cache/specmesh/train/corpus/*.u16 build/corpus/
# Then the run:  run(command="bash scripts/device_train_target.sh", carry=["build/corpus"], timeout_s=540)
# It trains on the same token stream as the CPU scripts (the carried build/corpus), with a
# large batch, and returns the fp16 model (shards ≤ 15 MB) in $OUT/target; copy it into
# build/models/target, evaluate (make model-cards) and publish (make publish-models).
set -euo pipefail
export PYTHONUNBUFFERED=1 SPECMESH_TRAIN_DIR=/tmp/specmesh-train
mkdir -p "$SPECMESH_TRAIN_DIR/corpus"
cp build/corpus/train.u16 build/corpus/heldout.u16 "$SPECMESH_TRAIN_DIR/corpus/"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m training.pretrain --preset target --device cuda --no-compile --batch "${BATCH:-64}" \
  --tokens "${TOKENS:-150000000}" --ckpt-minutes 2 --log-every 50 \
  --tokenizer models/tokenizer --out "$OUT/target"
ls -la "$OUT/target"
