#!/bin/bash
# alternating A/B rounds of bench.control_plane: before = $BEFORE (default /work/main, HEAD),
# after = $AFTER (default /tmp/dev), each run from its own checkout; results in $OUT;
# SESSIONS, TOPOLOGIES and METHODS narrow the runs (defaults as recorded)
OUT=${OUT:-/tmp/ab/lag}
SESSIONS=${SESSIONS:-64,256}
TOPOLOGIES=${TOPOLOGIES:-embedded,distributed}
METHODS=${METHODS:-suffix,hybrid}
BEFORE=${BEFORE:-/work/main}
AFTER=${AFTER:-/tmp/dev}
mkdir -p $OUT
for r in 1 2 3; do for side in before after; do
  dir=$BEFORE; [ $side = after ] && dir=$AFTER
  (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m bench.control_plane --sessions $SESSIONS \
     --topologies $TOPOLOGIES --methods $METHODS --count 1024 --out $OUT/${side}_$r > $OUT/${side}_$r.log 2>&1)
  echo "$side $r done $(date +%T)"
done; done
