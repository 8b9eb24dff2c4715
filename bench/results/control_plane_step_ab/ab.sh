#!/bin/bash
# the rounds of this folder: before = a worktree at d3c3e21 in /tmp/base, after = the checkout
OUT=${OUT:-/tmp/ab/step} BEFORE=/tmp/base AFTER=/work/main exec "$(dirname "$0")/../control_plane_lag_ab/ab.sh"
