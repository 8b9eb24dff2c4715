#!/bin/bash
# alternating A/B rounds: before = /work/main (HEAD), after = /tmp/dev
OUT=${OUT:-/tmp/ab/lag}
mkdir -p $OUT
for r in 1 2 3; do for side in before after; do
  dir=/work/main; [ $side = after ] && dir=/tmp/dev
  (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m bench.control_plane --sessions 64,256 \
     --topologies embedded,distributed --methods suffix,hybrid --count 1024 --out $OUT/${side}_$r > $OUT/${side}_$r.log 2>&1)
  echo "$side $r done $(date +%T)"
done; done
