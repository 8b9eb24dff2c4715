#!/bin/bash
# alternating A/B rounds of bench.control_plane: before = $BEFORE (default /work/main, HEAD),
# after = $AFTER (default /tmp/dev), each run from its own checkout; results in $OUT
OUT=${OUT:-/tmp/ab/lag}
BEFORE=${BEFORE:-/work/main}
AFTER=${AFTER:-/tmp/dev}
mkdir -p $OUT
for r in 1 2 3; do for side in before after; do
  dir=$BEFORE; [ $side = after ] && dir=$AFTER
  (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m bench.control_plane --sessions 64,256 \
     --topologies embedded,distributed --methods suffix,hybrid --count 1024 --out $OUT/${side}_$r > $OUT/${side}_$r.log 2>&1)
  echo "$side $r done $(date +%T)"
done; done
