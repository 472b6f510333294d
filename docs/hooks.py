"""MkDocs hook: the reference pages that are generated from the code at build time, so they cannot go
stale. ``reference/configuration.md`` comes from the run config's pydantic schema (the text of
``polyrl train --help-config``, :mod:`polyrl.config.reference`) and ``reference/cli.md`` from the
command line's own ``--help``. ``tests/test_docs.py`` checks both against the code."""

from __future__ import annotations

import contextlib
import io
import os
import re

GENERATED = {
    "reference/configuration.md": "configuration_page",
    "reference/sft-configuration.md": "sft_configuration_page",
    "reference/cli.md": "cli_page",
}

COMMANDS = ["train", "distill", "sft", "eval", "serve", "report", "export", "chat", "play", "tiny-model",
            "import-gguf", "init-env"]


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
        "# Configuration reference",
        "",
        "Every field of a run config (`polyrl train`, `polyrl distill`, `polyrl eval`), generated from the",
        "config's schema when the site is built: the same text as `polyrl train --help-config`. Set a field",
        "in the YAML or TOML file, or on the command line with `--overrides dotted.name=value`; a `<name>`",
        "in a path stands for the key you choose. Unknown keys are errors.",
        "",
        "See [A first config](../getting-started/first-config.md) for a config to start from, and the",
        "[`polyrl sft` reference](sft-configuration.md) for the supervised warm start's config.",
    ])


def sft_configuration_page() -> str:
    from polyrl.sft import SFTConfig

    return _config_page(SFTConfig, [
        "# `polyrl sft` configuration reference",
        "",
        "Every field of a supervised warm start's config (`polyrl sft`), generated from its schema when the",
        "site is built: the same text as `polyrl sft --help-config`. It trains on the demonstrations of the",
        "configured environments; the run config's fields are in the",
        "[configuration reference](configuration.md).",
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


def command_help(command: str) -> str:
    """``polyrl COMMAND --help`` as the terminal prints it (100 columns)."""
    from polyrl import cli

    out = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            cli.main([command, "--help"])
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return out.getvalue().rstrip()


def cli_page() -> str:
    out = [
        "# Command-line reference",
        "",
        "Every `polyrl` command and its flags, generated from the command line's own `--help` when the",
        "site is built. A bad argument is one `error:` line and exit code 2.",
        "",
    ]
    for command in COMMANDS:
        out += [f"## `polyrl {command}`", "", "```text", command_help(command), "```", ""]
    return "\n".join(out)


def on_files(files, config):
    from mkdocs.structure.files import File

    for path, function in GENERATED.items():
        files.append(File.generated(config, path, content=globals()[function]()))
    return files
