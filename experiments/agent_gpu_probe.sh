#!/bin/bash
# On the device (carry .whl, .whl_rl): which SFT recipe teaches k3-tiny to copy (experiments/agent_sft_probe.py,
# three recipes at once on the GPU), beside the k3-small agentic job (experiments/agent_gpu.yaml).
#   bash experiments/agent_gpu_probe.sh 2>&1 | tee $OUT/log
set -uo pipefail
R=$PWD
: "${OUT:?OUT must name the folder the results go to}"
BUDGET=${BUDGET:-480}
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
C=/tmp/probe
P="python3 $R/experiments/agent_sft_probe.py --device cuda --cache $C --episodes 2048 --every 50"
cd /tmp
pids=()
if [ "${SMALL:-1}" = 1 ]; then
  python3 "$R/experiments/learn_gpu.py" --config "$R/experiments/agent_gpu.yaml" --out /tmp/agent_small --name agent-small \
    --vary learner.seed=0 --budget-s "$BUDGET" --grace-s 40 > /tmp/small.log 2>&1 &
  pids+=($!)
fi
$P collect --steps 1 --every 1 2>&1 | tail -3          # the demonstrations, once
T=$((BUDGET - 100))
$P a3 --lr 3e-3 --batch 64 --steps 800 --budget-s $T --save "$OUT/a3" & pids+=($!)
$P a3b128 --lr 3e-3 --batch 128 --steps 800 --budget-s $T --save "$OUT/a3b128" & pids+=($!)
$P sp3 --envs S,P --lr 3e-3 --batch 64 --steps 800 --budget-s $T --save "$OUT/sp3" & pids+=($!)
tail -f /tmp/small.log & tailer=$!
wait "${pids[@]}"
kill $tailer
cp $C/*.json "$OUT"/ 2>/dev/null
d=/tmp/agent_small
cp "$d/learn_gpu.json" "$OUT/small.json" 2>/dev/null; cp "$d/learn_gpu.png" "$OUT/small.png" 2>/dev/null
cp "$d/mlflow.db" "$OUT/small-mlflow.db" 2>/dev/null
(cd "$d" 2>/dev/null && tar czf "$OUT/small-logs.tgz" ./*.log runs/*/summary.json runs/*/config.yaml 2>/dev/null)
cp /tmp/small.log "$OUT/" 2>/dev/null
ls -la "$OUT"
