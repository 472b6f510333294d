"""The reference pages generated from the code, and the MkDocs hook that keeps the site honest about them.

``reference/configuration.md``, ``reference/sft-configuration.md`` and ``reference/dpo-configuration.md``
come from the configs' pydantic schemas (the text of ``polyrl train``, ``sft`` and ``dpo --help-config``,
:mod:`polyrl.config.reference`), and ``reference/cli.md`` from the command line's own ``--help``. They are
committed, so they read on GitHub and in an editor too. ``python docs/hooks.py`` (run by ``make docs``)
rewrites them; ``python docs/hooks.py --check`` and ``mkdocs build`` fail when one differs from what the
code says now, and ``tests/test_docs.py`` checks the same."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REGENERATE = "python docs/hooks.py"

GENERATED = {
    "reference/configuration.md": "configuration_page",
    "reference/sft-configuration.md": "sft_configuration_page",
    "reference/dpo-configuration.md": "dpo_configuration_page",
    "reference/reward-model-configuration.md": "reward_model_configuration_page",
    "reference/cli.md": "cli_page",
}

NOTICE = "<!-- Generated from the code by docs/hooks.py: edit the code, then run `{}`. -->"


def config_fields(text: str) -> list[tuple[str, str, list[str]]]:
    """``(dotted name, "type, default", description lines)`` for every field of --help-config's text."""
    fields: list[tuple[str, str, list[str]]] = []
    for line in text.splitlines()[2:]:
        if line.startswith("    ") and fields:
            fields[-1][2].append(line.strip())
        elif line.strip():
            m = re.fullmatch(r"(\S+)  \((.*)\)", line)
            if m is None:
                raise ValueError(f"unexpected line in the config reference: {line!r}")
            fields.append((m.group(1), m.group(2), []))
    return fields


def configuration_page() -> str:
    from polyrl.config.schema import TrainConfig

    return _config_page(TrainConfig, [
        NOTICE.format(REGENERATE),
        "",
        "# Configuration reference",
        "",
        "Every field of a run config (`polyrl train`, `polyrl distill`, `polyrl eval`), generated from the",
        "config's schema: the same text as `polyrl train --help-config`. Set a field in the YAML or TOML",
        "file, or on the command line with `--overrides dotted.name=value`; a `<name>` in a path stands for",
        "the key you choose. Unknown keys are errors.",
        "",
        "See [A first config](../getting-started/first-config.md) for a config to start from, and the",
        "[`polyrl sft` reference](sft-configuration.md) for the supervised warm start's config.",
    ])


def sft_configuration_page() -> str:
    from polyrl.sft import SFTConfig

    return _config_page(SFTConfig, [
        NOTICE.format(REGENERATE),
        "",
        "# `polyrl sft` configuration reference",
        "",
        "Every field of a supervised warm start's config (`polyrl sft`), generated from its schema: the",
        "same text as `polyrl sft --help-config`. It trains on conversations (`--data`) and on the",
        "demonstrations of the configured environments; the run config's fields are in the",
        "[configuration reference](configuration.md).",
    ])


def dpo_configuration_page() -> str:
    from polyrl.dpo import DPOConfig

    return _config_page(DPOConfig, [
        NOTICE.format(REGENERATE),
        "",
        "# `polyrl dpo` configuration reference",
        "",
        "Every field of a Direct Preference Optimization run's config (`polyrl dpo`), generated from its",
        "schema: the same text as `polyrl dpo --help-config`. It trains on preference pairs (`--data`) and",
        "scores held-out ones (`--eval-data`); [Preferences and DPO](../guides/preferences.md) walks",
        "through it.",
    ])


def reward_model_configuration_page() -> str:
    from polyrl.reward_model import RewardModelConfig

    return _config_page(RewardModelConfig, [
        NOTICE.format(REGENERATE),
        "",
        "# `polyrl reward-model` configuration reference",
        "",
        "Every field of a reward model's training config (`polyrl reward-model`), generated from its",
        "schema: the same text as `polyrl reward-model --help-config`. It trains on preference pairs",
        "(`--data`) and scores held-out ones (`--eval-data`); [Preferences and DPO](../guides/preferences.md)",
        "walks through it.",
    ])


def _config_page(model, out: list[str]) -> str:
    from polyrl.config.reference import config_reference

    fields = config_fields(config_reference(model))
    sections = {name.split(".")[0] for name, _, _ in fields if "." in name}
    top_level = [f for f in fields if f[0] not in sections]
    out += ["", "## Top-level settings", ""] + [_item(*f) for f in top_level]
    for section in dict.fromkeys(name.split(".")[0] for name, _, _ in fields if name in sections):
        out += ["", f"## `{section}`", ""]
        out += [_item(*f) for f in fields if f[0].split(".")[0] == section]
    return "\n".join(out) + "\n"


def _item(name: str, kind: str, description: list[str]) -> str:
    text = " ".join(description)
    return f"- **`{name}`** (`{kind}`)" + (f": {_escape(text)}" if text else "")


def _escape(text: str) -> str:
    """Description text as Markdown: angle brackets and asterisks shown as written."""
    return text.replace("<", "&lt;").replace("*", r"\*")


def _help(argv: list[str]) -> str:
    """What ``polyrl ARGV`` prints (``--help``), as a terminal 100 columns wide shows it."""
    from polyrl import cli

    out = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            cli.main(argv)
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return out.getvalue().rstrip()


def commands() -> list[str]:
    """The subcommands, in the order ``polyrl --help`` lists them."""
    match = re.search(r"\{([a-z0-9,-]+)\}", _help(["--help"]))
    if match is None:
        raise ValueError("polyrl --help lists no {command,...} choice")
    return match.group(1).split(",")


def command_help(command: str) -> str:
    """``polyrl COMMAND --help`` as the terminal prints it (100 columns)."""
    return _help([command, "--help"])


def cli_page() -> str:
    out = [
        NOTICE.format(REGENERATE),
        "",
        "# Command-line reference",
        "",
        "Every `polyrl` command and its flags, generated from the command line's own `--help`. A bad",
        "argument is one `error:` line and exit code 2.",
        "",
    ]
    for command in commands():
        out += [f"## `polyrl {command}`", "", "```text", command_help(command), "```", ""]
    return "\n".join(out)


def stale_pages() -> list[str]:
    """The generated pages whose committed text differs from what the code gives now."""
    return [path for path, function in GENERATED.items()
            if not (DOCS / path).is_file()
            or (DOCS / path).read_text(encoding="utf-8") != globals()[function]()]


def write_pages() -> list[str]:
    """Rewrite the generated pages that are stale; the paths rewritten."""
    stale = stale_pages()
    for path in stale:
        (DOCS / path).write_text(globals()[GENERATED[path]](), encoding="utf-8")
    return stale


def on_pre_build(config) -> None:
    """MkDocs hook: refuse to build a site whose generated pages disagree with the code."""
    from mkdocs.exceptions import PluginError

    stale = stale_pages()
    if stale:
        raise PluginError(f"{', '.join(stale)} differ from the code: run `{REGENERATE}` (or `make docs`)")


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print("usage: python docs/hooks.py [--check]", file=sys.stderr)
        return 2
    if argv == ["--check"]:
        stale = stale_pages()
        for path in stale:
            print(f"docs/{path} differs from the code: run `{REGENERATE}`", file=sys.stderr)
        return 1 if stale else 0
    for path in write_pages():
        print(f"wrote docs/{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
