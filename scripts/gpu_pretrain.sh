#!/usr/bin/env bash
# Pre-train a target and a draft on a lent GPU machine (../.library/device), in one call.
#
# Here, first:   .venv/bin/python -m training.packages --out build/corpus
#                (the package and standard-library corpus as xz text, 21.7 MB: it travels
#                beside the repository, whose whole working tree may be 64 MiB)
# Then the run:  run(command="bash scripts/gpu_pretrain.sh", carry=["build/corpus"], timeout_s=540)
# The GPU machine tokenizes the corpus once, then trains both models at once on that token
# stream, then the EAGLE-3 head on the new target, each with its preset (TARGET_PRESET, DRAFT_PRESET; default the next pair) shortened,
# if need be, to MINUTES of wall clock. A rerun resumes from the checkpoints a cut-off run left
# (--ckpt-minutes 1) while the machine is still warm. The exports come back as
# $OUT/models.tar.part-* (15 MB each); here:
#   cat <files_at>/models.tar.part-* | tar xf - -C build   # -> build/models/{target,draft,eagle3}, build/logs
# then evaluate (make model-cards) and publish (make publish-models).
# Rehearse on the CPU: DEVICE=cpu MINUTES=0.3 EXTRA="--tokens 20000 --batch 2" TRACE_PROMPTS=4 TRACE_TOKENS=32 \
#   HEAD_CORPUS_TOKENS=4096 CORPUS=<small> bash scripts/gpu_pretrain.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 SPECMESH_TRAIN_DIR=${SPECMESH_TRAIN_DIR:-/tmp/specmesh-train}
OUT=${OUT:-build/gpu-out}
PY=${PY:-python3}
MINUTES=${MINUTES:-4}  # each model's training: with tokenizing, traces and the head, one 10-minute call
CORPUS=${CORPUS:-build/corpus}
TARGET_PRESET=${TARGET_PRESET:-target-next}
DRAFT_PRESET=${DRAFT_PRESET:-draft-next}
LOGS=build/logs  # travel back inside the archive: a call returns at most 8 files
mkdir -p "$OUT" build/models "$LOGS"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
for f in stdlib-train stdlib-heldout packages-train; do
  [ -s "$CORPUS/$f.txt.xz" ] || { echo "missing $CORPUS/$f.txt.xz: run python -m training.packages first"; exit 2; }
done
"$PY" -c "
import sys; from pathlib import Path
from training.pretrain import default_work_dir, encode_corpus
encode_corpus(Path('models/tokenizer'), default_work_dir('corpus'), Path(sys.argv[1]))" "$CORPUS" \
  > "$LOGS/corpus.log" 2>&1 || { tail -n 20 "$LOGS/corpus.log"; exit 1; }
cat "$LOGS/corpus.log"
for m in target draft; do
  preset=$([ "$m" = target ] && echo "$TARGET_PRESET" || echo "$DRAFT_PRESET")
  "$PY" -m training.pretrain --preset "$preset" --device "${DEVICE:-cuda}" --no-compile --threads 4 \
    --packages "$CORPUS" --max-minutes "$MINUTES" --ckpt-minutes 1 --log-every 50 ${EXTRA:-} \
    --tokenizer models/tokenizer --out "build/models/$m" > "$LOGS/$m.log" 2>&1 &
done
wait
tail -n 3 "$LOGS"/target.log "$LOGS"/draft.log
# The EAGLE-3 head for the new target: the target's greedy generations of training prompts,
# then training-time test over them plus windows of the corpus (features and soft labels from
# the target). HEAD=0 leaves it out.
if [ "${HEAD:-1}" = 1 ] && [ -s build/models/target/config.json ]; then
  mkdir -p build/traces
  "$PY" -m training trace --target build/models/target --device "${DEVICE:-cuda}" --method vanilla \
    --workload stdlib-train --limit "${TRACE_PROMPTS:-300}" --max-new-tokens "${TRACE_TOKENS:-256}" --concurrency 32 \
    --out build/traces/stdlib-train.jsonl > "$LOGS/traces.log" 2>&1 || tail -n 20 "$LOGS/traces.log"
  "$PY" -m training.eagle3 --target build/models/target --traces build/traces/stdlib-train.jsonl \
    --device "${DEVICE:-cuda}" --packages "$CORPUS" --corpus-tokens "${HEAD_CORPUS_TOKENS:-4000000}" \
    --draft-vocab 2048 --epochs 1 --lr 5e-4 --threads 4 --ckpt-minutes 1 \
    --work-dir "$SPECMESH_TRAIN_DIR/eagle3" --out build/models/eagle3 > "$LOGS/eagle3.log" 2>&1 \
    || tail -n 20 "$LOGS/eagle3.log"
  tail -n 3 "$LOGS"/eagle3.log
fi
tar cf - -C build models logs | split -b 15M - "$OUT/models.tar.part-"
ls -la "$OUT"
