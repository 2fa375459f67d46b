#!/bin/bash
# Source on the GPU device (torch and triton only, no internet) to install the carried wheels and
# lay k3rl out as an installed package (pyproject's package-dir: envs, rollout, learner, kernels,
# sandboxes, examples inside k3rl/). Carry .whl (pydantic & co., fla-core) and .whl_rl (benchmarks/device_wheels.sh).
#
#   source benchmarks/device_env.sh   # then python3 / pytest from anywhere but the repository root
R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .whl/annotated_types*.whl .whl/pydantic*.whl .whl/typing_insp*.whl $(ls .whl_rl/*.whl 2>/dev/null) 2>&1 | tail -2
[ -d /tmp/site/ray ] || [ ! -f .whl_rl/ray-slim.tar.xz ] || tar xJf .whl_rl/ray-slim.tar.xz -C /tmp/site
mkdir -p /tmp/pkg/k3rl && cp -r "$R"/k3rl/* /tmp/pkg/k3rl/
for d in envs rollout learner kernels sandboxes examples; do ln -sfn "$R/$d" "/tmp/pkg/k3rl/$d"; done
export PYTHONPATH=/tmp/pkg:/tmp/site OMP_NUM_THREADS=1 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled \
  PYTHONUNBUFFERED=1 TRITON_CACHE_DIR="$R/.cache/triton"
