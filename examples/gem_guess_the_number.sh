#!/bin/sh
# GEM's Tinker trainer command line (examples/train_tinker/tinker_train.py in GEM), run by polyrl: the
# same key=value arguments, with GEM's defaults for the ones not given.
#
# What it trains: SmolLM2-135M-Instruct on GEM's GuessTheNumber-v0-easy (multi-turn: GEM's game answers
# each guess; per-turn rewards), REINFORCE with return batch normalization (use_rebn=true, gamma=0.9,
# polyrl's advantages.estimator: rebn) and GEM's plain game prompt (template=qwen3_game).
#
# Run (needs GEM: pip install --no-deps gem-llm):
#   sh examples/gem_guess_the_number.sh
#   sh examples/gem_guess_the_number.sh max_steps=5 --print-config   # more GEM arguments win over these;
#                                                                    # then polyrl's own: --overrides k=v
#   offline, build the model once (polyrl tiny-model models/smollm2 --size smollm2-135m-instruct) and add
#   model_name=models/smollm2
#
# Expect: notes on stderr for what GEM's trainer does differently (the concat wrapper is left out: polyrl's
# episodes carry the conversation; batch_size counts episodes, GEM counts turns), then a console row per
# step; runs/gem-GuessTheNumber_v0_easy/ holds the run (metrics.jsonl, trajectories/, the report).
set -e
exec polyrl train env_id=game:GuessTheNumber-v0-easy model_name=HuggingFaceTB/SmolLM2-135M-Instruct \
    template=qwen3_game use_rebn=true gamma=0.9 batch_size=32 learning_rate=1e-4 lora_rank=16 \
    max_tokens=64 max_steps=50 save_every=10 "$@"
