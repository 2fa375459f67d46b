#!/bin/bash
# The agentic warm start's last SFT phases on the GPU, from the CPU phases' policy ($FROM): careful
# demonstrations of all three envs, then careless ones (oracle_mistakes 0.5: ScreenRead shows the other
# panel, PythonTool adds instead of multiplying, LongHorizon keeps no notes and drops the first code from
# its summaries), so RL starts from a policy that copies but chooses badly. k3-tiny runs with KDA chunk 64,
# so the Triton kernels take it (the same model: chunk 16 and 64 agree to 3e-5 in fp32); on an H100 an SFT
# step of 32 demonstrations takes 0.7 s against 14 s on the 2-core CPU.
#
#   device `run`, carry [".whl", ".whl_rl", ".cache/triton"]:
#   VARIANTS="A:150:60 B:300:60" bash experiments/agent_ws_device.sh 2>&1 | tee $OUT/log
#
# examples/agent_warm_start is made this way (one H100, 2026-12-06, 340 s), then cast to bf16 with
# `python -m k3rl.examples.make_warm_start A-p65 examples/agent_warm_start`:
#   VARIANTS="A:80:50" THEN="p65:24:S=0.5,P=0.65,L=0.5" EPISODES=1024 EVERY=40 BUDGET=120 DEADLINE=550 \
#     bash experiments/agent_ws_device.sh
#
# FROM: the policy the phases start from (default experiments/agent_sft600: the first 600 SFT steps of
# examples/agent_from_scratch.yaml, made on the CPU).
#
# VARIANTS: NAME:CAREFUL_STEPS:CARELESS_STEPS, run at once; EPISODES: careful demonstrations (more of them:
# more distinct PythonTool products, so the copy generalises to held-out tasks instead of being memorised). $OUT gets
# NAME-careful.tgz and NAME-careless.tgz (HF layout, fp32, config with chunk 16 again), logs.tgz (the probes' JSON
# and logs) and the Triton cache (triton-cache.tgz; TRITON_TGZ=path unpacks one first).
# THEN="TAG:STEPS:RATES ...": more careless phases from each variant's careless policy, at per-env rates
# (RATES as agent_sft_probe.py's --careless, e.g. S=0.8,P=0.8,L=0.5), run at once: NAME-TAG.tgz.
set -uo pipefail
R=$PWD
: "${OUT:?OUT must name the folder the results go to}"
FROM=${FROM:-$R/experiments/agent_sft600}
VARIANTS=${VARIANTS:-A:150:60} THEN=${THEN:-} EVERY=${EVERY:-20} LR=${LR:-1e-3} BUDGET=${BUDGET:-240} EPISODES=${EPISODES:-1024}
source benchmarks/device_env.sh
# TRITON_TGZ: a Triton cache an earlier run brought back (the compiles and autotuning of a fresh machine)
[ -n "${TRITON_TGZ:-}" ] && [ -f "$TRITON_TGZ" ] && mkdir -p "$R/.cache" && tar xzf "$TRITON_TGZ" -C "$R/.cache"
LA='{num_heads: 2, head_dim: 32, short_conv_kernel_size: 4, gate_lower_bound: -5.0, use_full_rank_gate: true, kda_layers: [1, 2, 3, 5, 6, 7], full_attn_layers: [4, 8], chunk_size: 64}'
W=/tmp/ws
mkdir -p $W
probe() {  # NAME FROM ARGS...
  local name=$1 from=$2; shift 2
  (cd /tmp && python3 "$R/experiments/agent_sft_probe.py" "$name" --device cuda --threads 2 --every "$EVERY" --cache $W \
     --set "model.overrides={linear_attn_config: $LA}" --set "model.checkpoint=$from" --save "$W/$name" "$@")
}
# the demonstrations once (cached in $W), before the variants share them
probe warmup "$FROM" --steps 1 --every 1 --episodes "$EPISODES" > $W/warmup.log 2>&1 && \
  probe warmup2 "$FROM" --steps 1 --every 1 --careless 0.5 --episodes 512 >> $W/warmup.log 2>&1
for t in $THEN; do
  IFS=: read -r tag steps rates <<< "$t"
  probe "warmup-$tag" "$FROM" --steps 1 --every 1 --careless "$rates" --episodes 512 >> $W/warmup.log 2>&1
done
rm -rf $W/warmup*/  # their policies (one SFT step) are not wanted
tail -3 $W/warmup.log
# one archive a policy (files come back from $OUT at most 16 MiB each, 8 of them), one for the logs
pack() {
  for d in $W/*/; do d=${d%/}; [ -f "$d/config.json" ] && (cd $W && tar czf "$OUT/$(basename "$d").tgz" "$(basename "$d")"); done
  (cd $W && tar czf "$OUT/logs.tgz" ./*.json ./*.log 2>/dev/null)
}
# DEADLINE=s: pack what there is by then too (the run's time limit would otherwise lose it all)
# (its output off the pipe: a sleeping writer would hold `| tee` open to the time limit)
[ -n "${DEADLINE:-}" ] && { (sleep "$DEADLINE"; pack) > /dev/null 2>&1 & }
then_phases() {  # NAME: THEN's phases from NAME-careless, at once
  local pids=() tag steps rates
  for t in $THEN; do
    IFS=: read -r tag steps rates <<< "$t"
    probe "$1-$tag" "$W/$1-careless" --careless "$rates" --episodes 512 --steps "$steps" --lr "$LR" \
      --budget-s "$BUDGET" > "$W/$1-$tag.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
}
pids=()
for v in $VARIANTS; do
  IFS=: read -r name careful careless <<< "$v"
  (probe "$name-careful" "$FROM" --steps "$careful" --lr "$LR" --budget-s "$BUDGET" \
     --episodes "$EPISODES" \
     && probe "$name-careless" "$W/$name-careful" --careless 0.5 --episodes 512 --steps "$careless" --lr "$LR" \
          --budget-s "$BUDGET" \
     && then_phases "$name") > $W/$name.log 2>&1 &
  pids+=($!)
done
tail -f $W/*.log &
tailer=$!
wait "${pids[@]}"
kill $tailer
for d in $W/*/; do  # the stored model says chunk 16, k3-tiny's own
  [ -f "$d/config.json" ] && sed -i 's/"chunk_size": 64/"chunk_size": 16/' "$d/config.json"
done
pack
(cd "$R/.cache" 2>/dev/null && tar czf "$OUT/triton-cache.tgz" triton 2>/dev/null)
ls -la "$OUT"
