#!/bin/bash
# usage: si.sh INTERVAL OUT [args...]
S=$1; OUT=$2; shift 2
.venv/bin/python -c "
import sys; sys.setswitchinterval($S)
from bench.control_plane import main
sys.argv=['control_plane']+sys.argv[1:]
sys.exit(main())" "$@" --out $OUT > /dev/null 2>&1
grep "| embedded\|| distributed\|| ray" $OUT.md | cut -d'|' -f2-4,7-9,12-15,18 | sed "s/^/$S /"
