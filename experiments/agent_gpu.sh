#!/bin/bash
# The agentic workload on one H200 (no Docker, no internet): two jobs at once, each a learn_gpu.py run.
#   agent-small: k3-small learns ScreenRead and LongHorizon from scratch (experiments/agent_gpu.yaml: SFT, then RL)
#   agent-tiny:  examples/agent_from_scratch.yaml on the GPU (k3-tiny, fp32): its SFT is the CPU job's warm
#                start (checkpoint step 0, stored in bf16 as examples/agent_warm_start by make_warm_start.py),
#                then the same RL as examples/agent.yaml
# Both run their sandboxed tools unsandboxed, by name (sandbox.backend: none).
#
#   bash benchmarks/device_wheels.sh      # here, once
#   # device `run`, carry [".whl", ".whl_rl"]:
#   bash experiments/agent_gpu.sh 2>&1 | tee $OUT/log
#
# $OUT gets: small.json/png, tiny.json/png, both MLflow stores, the jobs' logs and the warm start.
set -uo pipefail
R=$PWD
: "${OUT:?OUT must name the folder the results go to}"
BUDGET=${BUDGET:-520}
JOBS=${JOBS:-small tiny}   # JOBS=small runs the k3-small job alone
source benchmarks/device_env.sh
(cd /tmp && python3 -c "import k3rl.job, k3rl.examples, ray, mlflow, gymnasium; print('imports ok')")
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
rm -rf /tmp/agent_small /tmp/agent_tiny
pids=()
if [[ " $JOBS " == *" small "* ]]; then
python3 experiments/learn_gpu.py --config experiments/agent_gpu.yaml --out /tmp/agent_small --name agent-small \
  --vary learner.seed=0 --budget-s "$BUDGET" --grace-s 40 --set learner.micro_batch_tokens=32768 "$@" \
  > /tmp/small.log 2>&1 &
pids+=($!)
fi
if [[ " $JOBS " == *" tiny "* ]]; then
python3 experiments/learn_gpu.py --config examples/agent_from_scratch.yaml --out /tmp/agent_tiny --name agent-tiny \
  --vary learner.seed=0 --budget-s "$BUDGET" --grace-s 40 --set model.preset=k3-tiny --set model.dtype=float32 \
  --set learner.bf16=false --set sandbox.backend=none --set learner.micro_batch_tokens=32768 --set sandbox.pool_size=16 \
  ${TINY_SFT:---set learner.sft_steps=500 --set learner.sft_batch=64 --set learner.sft_episodes=2048 \
  --set 'learner.sft_phases=[{from_step: 430, env_kwargs: {oracle_mistakes: 0.5}}]' --set learner.eval_before_training=true} \
  > /tmp/tiny.log 2>&1 &
pids+=($!)
fi
touch /tmp/small.log /tmp/tiny.log
tail -f /tmp/small.log /tmp/tiny.log &
tailer=$!
wait "${pids[@]}"
kill $tailer
for j in small tiny; do
  d=/tmp/agent_$j
  cp "$d/learn_gpu.json" "$OUT/$j.json" 2>/dev/null; cp "$d/learn_gpu.png" "$OUT/$j.png" 2>/dev/null
  cp "$d/mlflow.db" "$OUT/$j-mlflow.db" 2>/dev/null
  (cd "$d" && tar czf "$OUT/$j-logs.tgz" ./*.log runs/*/summary.json runs/*/config.yaml 2>/dev/null)
done
ws=$(ls -d /tmp/agent_tiny/runs/*/checkpoints/step-000000/model 2>/dev/null | head -1)
[ -n "$ws" ] && (cd /tmp && python3 -m k3rl.examples.make_warm_start "$ws" "$OUT/agent_warm_start")
# the Triton cache (autotuning of k3-small's shapes) comes back to spare the next fresh device minutes
(cd "$R/.cache" 2>/dev/null && tar czf "$OUT/triton-cache.tgz" triton 2>/dev/null)
ls -la "$OUT" "$OUT/agent_warm_start" 2>/dev/null
