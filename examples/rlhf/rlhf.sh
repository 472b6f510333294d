#!/bin/sh
# RLHF end to end on a small local data set: supervised fine-tuning on demonstrations, a reward model
# trained from preference pairs, then RL from the SFT state against the reward model
# (docs/guides/preferences.md walks through it).
#
# What it trains: arithmetic answers said plainly. Stage 1 (sft.yaml) warm-starts the policy on
# demos.jsonl; stage 2 (reward_model.yaml) trains a reward model on examples/dpo/pairs.jsonl, scored on
# held_out.jsonl; stage 3 (train.yaml) trains the policy from stage 1's state with stage 2's score as its
# reward, on the pairs' questions. Each stage reads the path the one before wrote (sft.json,
# reward_model.json).
#
# Run:
#   sh examples/rlhf/rlhf.sh
#   every argument is a dotted override given to all three stages; offline or on a CPU, build a model
#   first (polyrl tiny-model models/tiny --size quickstart-cpu) and add model_name=models/tiny;
#   OUT=dir puts the three runs under dir (default runs/rlhf)
#
# Expect: three runs under runs/rlhf: sft/ (optim/loss (per token) falling), reward_model/ (held-out accuracy up from
# 0.5), rl/ (env/arithmetic/judge/score rising; test/arithmetic/judge_score after above before).
set -e
OUT=${OUT:-runs/rlhf}
field() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }

polyrl sft --config_path examples/rlhf/sft.yaml --overrides "log_path=$OUT/sft" "$@"
polyrl reward-model --config_path examples/rlhf/reward_model.yaml --overrides "log_path=$OUT/reward_model" "$@"
polyrl train --config_path examples/rlhf/train.yaml --overrides "log_path=$OUT/rl" \
    "resume_from=$(field "$OUT/sft/sft.json" state_path)" \
    "environments.arithmetic.judge.model=$(field "$OUT/reward_model/reward_model.json" sampler_path)" "$@"
