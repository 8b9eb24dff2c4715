#!/usr/bin/env bash
# Pre-train the bundled target and draft on a lent GPU machine (../.library/device), in one call.
#
# Here, first:   make setup && .venv/bin/python -m training.pretrain --preset target --out /tmp/x --tokens 1 \
#                  && mkdir -p build/corpus && cp ~/.cache/specmesh/train/corpus/*.u16 build/corpus/
# Then the run:  run(command="bash scripts/gpu_pretrain.sh", carry=["build/corpus"], timeout_s=540)
# Both models train at once on the same token stream as the CPU scripts (the carried
# build/corpus), each with its preset (large batch) shortened, if need be, to MINUTES of wall
# clock. The exports come back as $OUT/models.tar.part-*; here:
#   cat /work/.device/.../models.tar.part-* | tar xf - -C build   # -> build/models/{target,draft}
# then evaluate (make model-cards) and publish (make publish-models).
set -uo pipefail
export PYTHONUNBUFFERED=1 SPECMESH_TRAIN_DIR=/tmp/specmesh-train
OUT=${OUT:-build/gpu-out}
MINUTES=${MINUTES:-6}
mkdir -p "$SPECMESH_TRAIN_DIR/corpus" "$OUT" build/models
cp build/corpus/train.u16 build/corpus/heldout.u16 "$SPECMESH_TRAIN_DIR/corpus/"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
for m in target draft; do
  "${PY:-python3}" -m training.pretrain --preset "$m" --device "${DEVICE:-cuda}" --no-compile --threads 4 \
    --max-minutes "$MINUTES" --ckpt-minutes 1 --log-every 50 ${EXTRA:-} \
    --tokenizer models/tokenizer --out "build/models/$m" > "$OUT/$m.log" 2>&1 &
done
wait
tail -n 3 "$OUT"/*.log
tar cf - -C build models | split -b 15M - "$OUT/models.tar.part-"
ls -la "$OUT"
