#!/bin/bash
# alternating A/B rounds: before = /tmp/base (a worktree at d3c3e21), after = /work/main
OUT=${OUT:-/tmp/ab/step}
mkdir -p $OUT
for r in 1 2 3; do for side in before after; do
  dir=/work/main; [ $side = before ] && dir=/tmp/base
  (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m bench.control_plane --sessions 64,256 \
     --topologies embedded,distributed --methods suffix,hybrid --count 1024 --out $OUT/${side}_$r > $OUT/${side}_$r.log 2>&1)
  echo "$side $r done $(date +%T)"
done; done
