#!/usr/bin/env bash
# Where the engine's CUDA step goes, on a lent GPU machine (../.library/device), in one call.
# The last run's record and findings: bench/results/cuda/2026-12-04/README.md.
#
# Here, first:   scripts/gpu_wheels.sh   (our pinned packages the machine's image lacks or has too old, as
#                cp312 wheels in .whl/: the generated gRPC and protobuf code needs grpcio >= 1.85.1 and
#                protobuf >= 7.35.1; `specmesh serve` needs fastapi, uvicorn, redis, outlines-core)
# Then the run:  run(command="bash scripts/gpu_cuda_check.sh", carry=[".whl"], timeout_s=560)
# Each step has its own time limit (STEP_S scales them all), so one slow step cannot eat the call:
# a step cut off leaves its log (progress lines with rates) in the archive.
# Steps, in the order the GPU-evidence issue asks for them; each writes NAME.{json,md,log} into one
# archive, $OUT/gpu_cuda_check.tar (a device call returns at most 8 files):
#   bf16_lossless   lossless methods against vanilla in bf16 with batch-invariant verification on and
#                   off, and fp32 with the host loop's per-token reads (float32-host-drafts; CUDA's
#                   default is device drafts) and with --static-steps (CUDA graphs, float32-static);
#   bench           `python -m bench` beside transformers' generate (hf-vanilla, hf-assisted): per-token
#                   times and each method's speedup;
#   op_profile      operators and host waits per cycle (bench.op_profile), bf16, drafting methods first;
#   compile         decode and 5-token verify steps: the eager forward against the static-shape one,
#                   eager and replayed from CUDA graphs (torch.compile's reduce-overhead, whose
#                   compilation may take a minute, is the last step: compile_inductor);
#   serving         bench.serving, embedded, vanilla: aggregate tokens/s at 1, 8 and 32 streams (x32 >= 10x);
#   pair_cost       a 1-layer draft's step against target shapes (the draft at most 10 % of a step);
#   step_reads      a step's greedy verdicts: each session's rows copied to the host against one
#                   batched read of the step (policies.read_greedy), 1-128 sessions;
#   lossless_fp32   fp32, trees included: every lossless method equals vanilla token for token;
#   kv_pool, trees, link_hop, prefill, compile_inductor: the pooled attention, token trees, the
#                   verifier hop, the --prefill-chunk for a GPU, torch.compile; last (they may not fit).
# Not here: tensor parallel over NCCL needs a GPU per rank, and the machine lent has one, so only
# TP 1 runs (on a machine with two: python -m bench.tensor_parallel --device cuda --tensor-parallel 2).
# The archive is re-made after each step, so a run cut off at its limit still returns what it
# finished. Here: tar xf <files_at>/gpu_cuda_check.tar -C bench/results/cuda/ (the .md files
# are the record), and read them before changing the CUDA step.
set -uo pipefail
OUT=${OUT:-build/gpu-out}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
SCALE=${STEP_S:-1}      # multiplies every step's limit (a CPU rehearsal: STEP_S=4)
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site .whl/*.whl \
    || echo "wheel install failed"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
W=$(mktemp -d)          # the step outputs; $OUT gets one archive of them after each step
mkdir -p "$OUT"
pack() { rm -f "$W"/*.png; tar cf "$OUT/gpu_cuda_check.tar.tmp" -C "$W" . && mv "$OUT/gpu_cuda_check.tar.tmp" "$OUT/gpu_cuda_check.tar"; }
# step NAME SECONDS CMD...: CMD under a time limit, its output in NAME.log, the archive re-made after it
step() {
  local name=$1 limit=$(( $2 * SCALE )); shift 2
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$W/steps.txt"
  [ "$rc" = 0 ] || tail -n 12 "$W/$name.log"
  pack
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$W/device.txt" 2>&1 || true
"$PY" -c "import torch, transformers, grpc, google.protobuf as pb; print('torch', torch.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__)" >> "$W/device.txt" 2>&1
cat "$W/device.txt"
step bf16_lossless 110 "$PY" -m bench.bf16_lossless --device "$DEVICE" --modes bfloat16-invariant,bfloat16,float32-static,float32-host-drafts \
  --prompts 1 --max-new-tokens 48 --out "$W/bf16_lossless.json"
step bench 100 "$PY" -m bench --device "$DEVICE" --threads 1 --workload humaneval --limit 4 --max-new-tokens 96 \
  --methods vanilla,sd,eagle3,hybrid,hf-vanilla,hf-assisted --out "$W/bench.json"
# 2026-12-04: bf16 sd/eagle3 drafted at 38-41 ms a cycle against 3.5 ms in fp32: where it goes
step op_profile 60 "$PY" -m bench.op_profile --device "$DEVICE" --threads 0 --methods sd,eagle3,vanilla --prompts 1 \
  --max-new-tokens 48 --out "$W/op_profile.json"
DT=$([ "$DEVICE" = cpu ] && echo float32 || echo bfloat16)
step compile 70 "$PY" -m bench.compile --device "$DEVICE" --dtype "$DT" \
  --variants "eager,static$([ "$DEVICE" = cpu ] || echo ,static-graphs)" --rounds 2 --steps 20 --tokens 32 --out "$W/compile.json"
step serving 100 "$PY" -m bench.serving --methods vanilla --concurrency 1,8,32 --limit 32 --max-batch 32 --max-new-tokens 64 \
  --overhead-prompts 1 --repeats 1 --window-s 6 --warmup-s 2 --server-threads 1 --topologies embedded --out "$W/serving.json"
step pair_cost 30 "$PY" -m bench.pair_cost --device "$DEVICE" --targets 8x256,12x512 --drafts 1x128,1x256 --rounds 2 \
  --out "$W/pair_cost.json"
step step_reads 20 "$PY" -m bench.step_reads --device "$DEVICE" --dtype "$DT" --rounds 10 --out "$W/step_reads.json"
step lossless_fp32 60 "$PY" -m bench --device "$DEVICE" --dtype float32 --threads 1 --workload humaneval --limit 3 \
  --max-new-tokens 64 --methods vanilla,sd,eagle3,hybrid,suffix-tree,eagle3-tree,hybrid-tree --out "$W/lossless_fp32.json"
step kv_pool 40 "$PY" -m bench.step_profile --device "$DEVICE" --batches 1,8,16 --kv-pools off,on --repeats 1 --out "$W/kv_pool.json"
step trees 40 "$PY" -m bench.trees --device "$DEVICE" --threads 1 --workload humaneval --limit 3 --max-new-tokens 64 \
  --shapes 2:4:6:0.1,4:6:16:0 --out "$W/trees.json"
step link_hop 30 "$PY" -m bench.link_hop --device "$DEVICE" --limit 3 --cycles 16 --out "$W/link_hop.json"
step prefill 40 "$PY" -m bench.prefill --device "$DEVICE" --threads 1 --method hybrid --chunks 0,512,256,128 --repeats 1 \
  --out "$W/prefill.json"
step compile_inductor 60 "$PY" -m bench.compile --device "$DEVICE" --dtype "$DT" \
  --variants "eager,$([ "$DEVICE" = cpu ] && echo compile || echo reduce-overhead)" --rounds 2 --steps 20 --tokens 32 \
  --out "$W/compile_inductor.json"
tar tvf "$OUT/gpu_cuda_check.tar"
