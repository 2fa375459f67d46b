#!/bin/bash
# experiments/learn_gpu.py on the GPU device (one H200, no internet, torch and triton only): install
# the carried wheels, lay k3rl out as an installed package, run both jobs, leave the results in $OUT.
#
#   bash benchmarks/device_wheels.sh           # here, once: .whl_rl/ (pydantic & co. are in .whl/)
#   # device `run`, carry [".whl", ".whl_rl"] (and ".cache" to reuse an earlier run's Triton cache):
#   bash experiments/learn_gpu.sh 2>&1 | tee $OUT/log
#   bash experiments/learn_gpu.sh --task num_keys=6 --set learner.sft_steps=10 2>&1 | tee $OUT/log
#
# Arguments go to learn_gpu.py (--budget-s 480 and --grace-s 40 by default: with the ~30 s of
# installing, the run ends inside the device's 600 s). $OUT gets (at most 8 files come back):
# log, learn_gpu.json, learn_gpu.png, compare.png, mlflow.db, runs.tgz (the jobs' logs, configs,
# summaries and Parquet episodes; no checkpoints) and triton_cache.tgz (unpack it into .cache/
# here and carry .cache next time to skip the kernels' compile).
set -uo pipefail
R=$PWD
: "${OUT:?OUT must name the folder the results go to}"
source benchmarks/device_env.sh
# from /tmp: in the repository root `k3rl` would be its source folder, which lacks the linked packages
(cd /tmp && python3 -c "import k3rl.job, k3rl.learner.trainer, k3rl.rollout.engine, ray, mlflow, gymnasium; print('imports ok')")
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
rm -rf /tmp/learn_gpu  # a warm machine keeps the last run's
python3 experiments/learn_gpu.py --out /tmp/learn_gpu "$@"
rc=$?
cd /tmp/learn_gpu 2>/dev/null || exit $rc
cp learn_gpu.json learn_gpu.png compare.png mlflow.db "$OUT"/ 2>/dev/null
tar czf "$OUT/runs.tgz" --exclude=checkpoints ./*.log runs artifacts 2>/dev/null
[ "$(stat -c %s "$OUT/runs.tgz")" -le 16000000 ] || { echo "runs.tgz over 16 MB: kept the logs only"; tar czf "$OUT/runs.tgz" ./*.log; }
tar czf "$OUT/triton_cache.tgz" -C "$R" .cache/triton 2>/dev/null || rm -f "$OUT/triton_cache.tgz"
[ "$(stat -c %s "$OUT/triton_cache.tgz" 2>/dev/null || echo 0)" -le 16000000 ] || rm -f "$OUT/triton_cache.tgz"
ls -la "$OUT"
exit $rc
