"""The ``polyrl`` command line: one subcommand per job, each with its own ``--help``.

Problems with what was asked (config, model directory, checkpoint path) print one ``error: ...`` line
and exit with code 2 (no traceback); a run that had to stop (a service gone, no learning signal) prints
one such line and exits with 1; Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from polyrl.errors import UserInputError
from polyrl.models.tiny import size_names
from polyrl.secrets import redact, redact_text, redact_tracebacks


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config_path", "--config", dest="config_path", help="YAML or TOML run config")
    p.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="dotted overrides, e.g. batch_size=64 environments.arithmetic.num_rollouts=8")
    p.add_argument("--help-config", action="store_true", help="print every config field and exit")
    p.add_argument("--print-config", action="store_true",
                   help="print the config the run would use (YAML, secrets masked; translated configs "
                        "too) and exit")


def _load(args, model):
    from polyrl.config.files import load_config, load_dotenv_file
    from polyrl.config.reference import config_reference
    from polyrl.config.schema import TrainConfig

    if args.help_config:
        print(config_reference(model))
        sys.exit(0)
    translation = None
    if model is TrainConfig:  # other harnesses' configs and command lines (polyrl.compat)
        from polyrl.compat import translate_run

        load_dotenv_file()  # a translation looks for API keys, which may be in .env
        translation = translate_run(args.config_path, getattr(args, "arguments", []))
    if not args.config_path and not args.overrides and translation is None:
        raise UserInputError("give --config_path and/or --overrides (see --help-config)")
    if translation is not None:
        config = load_config(None, args.overrides, model=model, base=translation.data)
    else:
        config = load_config(args.config_path, args.overrides, model=model)
    for line in config.renamed_warnings:
        print(f"warning: {line}", file=sys.stderr)
    if args.print_config:
        print(_config_yaml(config, translation), end="")
        sys.exit(0)
    from polyrl.backend import placeholder_key_note

    for note in [*(translation.notes if translation else []), placeholder_key_note(config)]:
        if note:
            print(f"note: {note}", file=sys.stderr)
    return config


def _config_yaml(config, translation) -> str:
    """The validated config as YAML that ``--config_path`` reads back, with what it was translated
    from (and the notes on the translation) as comments."""
    import yaml

    from polyrl.secrets import redact_config

    header = []
    if translation is not None:
        header = [f"# translated from {translation.source}", *(f"# note: {n}" for n in translation.notes)]
    body = yaml.safe_dump(redact_config(config.model_dump(mode="json")), sort_keys=False, allow_unicode=True)
    return "".join(line + "\n" for line in header) + body


def cmd_train(args) -> None:
    from polyrl.config.schema import TrainConfig

    config = _load(args, TrainConfig)  # a mistake in it is said before the heavy imports below
    from polyrl.rl.train import train

    print(_final_line(train(config), config))


def _final_line(row: dict, config, also: tuple[str, ...] = ()) -> str:
    """The last step's rewards, successes and held-out scores (and ``also``'s keys) as one JSON line; with
    the held-out scores before training beside them as ``before/test/...``."""
    from polyrl.rl.train import held_out_before

    kept = ("reward", "success", "pass@", *also)
    shown = {k: v for k, v in row.items() if any(part in k for part in kept)}
    shown.update({f"before/{k}": v for k, v in held_out_before(config.log_path).items()
                  if "reward" in k or "pass@" in k})
    return json.dumps(redact(shown, False))


def cmd_distill(args) -> None:
    """``polyrl train`` with a teacher: the config's ``teacher:`` block, its model named on the command
    line."""
    from polyrl.config.schema import TrainConfig

    if args.teacher:
        args.overrides = [f"teacher.model={json.dumps(args.teacher)}", *args.overrides]
    config = _load(args, TrainConfig)
    if config.teacher is None:
        raise UserInputError("distill needs a teacher: give TEACHER (a tinker://<run>/sampler_weights/<name> "
                             "checkpoint or a base model) or a teacher: block in the config")
    from polyrl.rl.train import train

    print(_final_line(train(config), config, also=("kl/",)))


def cmd_sft(args) -> None:
    from polyrl.sft import SFTConfig, sft

    if args.data:  # before --overrides, which win
        files = [path for group in args.data for path in group]
        args.overrides = [f"data={json.dumps(files)}", *args.overrides]
    config = _load(args, SFTConfig)
    print(sft(config))


def _pair_files(args) -> None:
    """``--data`` and ``--eval-data`` as overrides (before the given ones, which win)."""
    for flag, key in ((args.data, "data"), (args.eval_data, "eval_data")):
        if flag:
            files = [path for group in flag for path in group]
            args.overrides = [f"{key}={json.dumps(files)}", *args.overrides]


def cmd_dpo(args) -> None:
    from polyrl.dpo import DPOConfig, dpo

    _pair_files(args)
    print(dpo(_load(args, DPOConfig)))


def cmd_reward_model(args) -> None:
    from polyrl.reward_model import RewardModelConfig, reward_model

    _pair_files(args)
    print(reward_model(_load(args, RewardModelConfig)))


def cmd_eval(args) -> None:
    from polyrl.config.schema import TrainConfig

    config = _load(args, TrainConfig)
    from polyrl.evaluate import evaluate_checkpoint

    metrics = redact(asyncio.run(evaluate_checkpoint(config, args.checkpoint)), False)
    width = max(len(k) for k in metrics) if metrics else 0
    for k, v in sorted(metrics.items()):
        print(f"{k:<{width}}  {v:.4f}")


def cmd_tiny_model(args) -> None:
    from polyrl.models.tiny import build_tiny_model

    print(build_tiny_model(args.out_dir, args.size, args.seed))


def cmd_import_gguf(args) -> None:
    from polyrl.models.gguf import import_gguf

    print(import_gguf(args.gguf_file, args.out_dir))


def cmd_report(args) -> None:
    from polyrl.report import build_report

    try:
        print(build_report(args.log_path, force=args.force))
    except FileNotFoundError as e:
        raise UserInputError(str(e)) from e
    except OSError as e:  # a run directory that cannot be written to
        raise UserInputError(f"cannot write the report under {args.log_path}: {e.strerror or e}") from e


def cmd_serve(args) -> None:
    from polyrl.serve.main import run

    run(args)


def cmd_export(args) -> None:
    from polyrl.export import export_checkpoint

    print(export_checkpoint(args.checkpoint, args.out_dir, merged=args.merged, store_dir=args.store_dir))


def cmd_chat(args) -> None:
    from polyrl.interactive import run_chat

    run_chat(args)


def cmd_play(args) -> None:
    from polyrl.interactive import run_play

    run_play(args)


def cmd_init_env(args) -> None:
    from polyrl.init_env import init_env

    print(init_env(args.name, args.dir, model=args.model))


def _pair_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--data", action="append", nargs="+", metavar="FILE.jsonl",
                   help='preference pairs to learn, one JSON object a line: {"prompt": ..., "chosen": ..., '
                        '"rejected": ...} (TRL\'s preference format); sets the config\'s data')
    p.add_argument("--eval-data", action="append", nargs="+", metavar="FILE.jsonl",
                   help="held-out pairs, scored during and after training; sets the config's eval_data")


def main(argv: list[str] | None = None) -> None:
    redact_tracebacks()
    parser = argparse.ArgumentParser(prog="polyrl")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="RL training on the configured environments")
    _config_args(p)
    p.add_argument("arguments", nargs="*", metavar="KEY=VALUE",
                   help="GEM trainer style arguments instead of a config, e.g. "
                        "env_id=game:GuessTheNumber-v0-easy max_steps=20 gamma=0.9 use_rebn=true "
                        "template=qwen3_game (before any --overrides)")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("distill", help="on-policy distillation: the policy samples, a teacher scores every "
                                       "sampled token (polyrl train with a teacher: block)")
    p.add_argument("teacher", nargs="?",
                   help="the teacher: a tinker://<run>/sampler_weights/<name> checkpoint or a base model "
                        "with the same tokenizer (sets teacher.model)")
    _config_args(p)
    p.set_defaults(fn=cmd_distill)

    p = sub.add_parser("sft", help="supervised warm start on conversations (--data FILE.jsonl) and/or "
                                   "environment demonstrations")
    _config_args(p)
    p.add_argument("--data", action="append", nargs="+", metavar="FILE.jsonl",
                   help="conversations to learn, one JSON object a line in the OpenAI chat format "
                        '({"messages": [...]}); sets the config\'s data')
    p.set_defaults(fn=cmd_sft)

    p = sub.add_parser("dpo", help="Direct Preference Optimization on preference pairs (--data FILE.jsonl), "
                                   "against the starting policy as reference")
    _pair_args(p)
    p.set_defaults(fn=cmd_dpo)

    p = sub.add_parser("reward-model", help="a reward model from preference pairs (Bradley-Terry), for "
                                            "polyrl train's judge: {mode: reward_model}")
    _pair_args(p)
    p.set_defaults(fn=cmd_reward_model)

    p = sub.add_parser("eval", help="mean reward, pass@1 and pass@k on the test splits")
    _config_args(p)
    p.add_argument("--checkpoint",
                   help="a tinker://.../sampler_weights/<name> (or weights) path; default: base model")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("tiny-model", help="write a tiny Qwen3-architecture model + ChatML tokenizer")
    p.add_argument("out_dir")
    sizes: dict[str, list[str]] = {}
    for name, kind in size_names().items():
        sizes.setdefault(kind, []).append(name)
    p.add_argument("--size", default="unit",
                   help="; ".join(f"{' | '.join(names)} ({kind})" for kind, names in sizes.items()))
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_tiny_model)

    p = sub.add_parser("import-gguf",
                       help="dequantize a GGUF file (llama.cpp, Ollama) into a model directory")
    p.add_argument("gguf_file")
    p.add_argument("out_dir", help="a new or empty directory")
    p.set_defaults(fn=cmd_import_gguf)

    p = sub.add_parser("report", help="write LOG_PATH/report/index.html: curves, trajectory browser, config")
    p.add_argument("log_path", help="a run's log_path (metrics.jsonl, trajectories/, checkpoints.jsonl)")
    p.add_argument("--force", action="store_true", help="rewrite every file instead of only what changed")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("serve",
                       help="serve the local engine over Tinker's HTTP protocol (for the tinker SDK)")
    from polyrl.serve.main import add_arguments

    add_arguments(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("export",
                       help="write a checkpoint as a PEFT adapter directory or (--merged) a full HF model")
    p.add_argument("checkpoint", help="tinker://<run>/sampler_weights/<name> (or weights), a checkpoint "
                                      "directory or a run's log_path (its latest checkpoint)")
    p.add_argument("out_dir", help="a new directory (never overwritten)")
    p.add_argument("--merged", action="store_true", help="fold the adapter into the base weights: a standard "
                                                         "Hugging Face model directory with the tokenizer")
    p.add_argument("--store_dir", "--store-dir", dest="store_dir",
                   help="local checkpoint store for tinker:// paths")
    p.set_defaults(fn=cmd_export)

    from polyrl.interactive import add_chat_arguments, add_play_arguments

    p = sub.add_parser("chat", help="talk to a trained policy (or a base model) in the terminal")
    add_chat_arguments(p)
    p.set_defaults(fn=cmd_chat)

    p = sub.add_parser("play", help="play an environment by hand, seeing what the policy sees, or watch a "
                                    "policy play")
    add_play_arguments(p)
    p.set_defaults(fn=cmd_play)

    p = sub.add_parser("init-env", help="write a new environment package: its module, test, pyproject.toml "
                                        "(a polyrl.environments entry point), a config that trains on it "
                                        "and one that warm-starts the model for it (polyrl sft)")
    p.add_argument("name", help="the environment's name (its config type and, with '-' as '_', its module)")
    p.add_argument("dir", nargs="?", help="a new or empty directory (default: ./NAME)")
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                   help="model_name of the configs it writes: a local model directory (polyrl tiny-model DIR "
                        "builds a tiny one) or a Hugging Face id")
    p.set_defaults(fn=cmd_init_env)

    parser.description = "polyrl: " + " | ".join(sub.choices) + "."
    args = parser.parse_args(argv)
    from polyrl.errors import RunStoppedError, UserInputError

    try:
        args.fn(args)
    except UserInputError as e:
        print(f"error: {redact_text(str(e))}", file=sys.stderr)
        sys.exit(2)
    except RunStoppedError as e:
        print(f"error: {redact_text(str(e))}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        _exit_stopping_engines(130)


ENGINE_STOP_S = 10.0  # how long Ctrl-C waits for the operation the local engine is running


def _exit_stopping_engines(code: int) -> None:
    """Exit with ``code`` once the local engine's worker has stopped (its queued work cancelled, the
    operation it runs finished): a worker still in torch code while the interpreter shuts down aborts
    the process. If it does not stop in time (a long operation, or a second Ctrl-C), exit at once,
    skipping the interpreter's shutdown."""
    engine = sys.modules.get("polyrl.local.engine")  # not imported: nothing to stop
    try:
        stopped = engine is None or engine.Engine.stop_all(ENGINE_STOP_S)
    except KeyboardInterrupt:
        stopped = False
    if not stopped:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
