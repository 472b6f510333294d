"""The README and the documentation site (docs/, built by ``make docs`` with MkDocs in CI): the README stays a
short front door with a picture, every relative link resolves, the nav names pages that exist, and the
reference pages generated from the code (docs/hooks.py) are committed as the code gives them now and list
every config field and every command."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from polyrl.config.reference import config_reference
from polyrl.config.schema import TrainConfig
from polyrl.sft import SFTConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prose(text: str) -> str:
    """Markdown without fenced code blocks and inline code, where a bracket is not a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def links(text: str) -> list[str]:
    """Targets of Markdown links and images: ``[text](target)`` and ``![alt](target)``."""
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(text))


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_the_readme_is_short_and_has_a_picture():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    words = len(readme.split())
    assert words <= 1600, f"README.md has {words} words; the details belong in docs/"
    images = re.findall(r"!\[[^\]]+\]\(([^)\s]+)\)", readme)
    assert "docs/assets/architecture.svg" in images, "the README shows how the parts fit"
    assert any(i.endswith(".png") for i in images), "the README shows a report"


def test_every_relative_link_resolves():
    broken = []
    for page in markdown_files():
        for target in links(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page (MkDocs checks anchors in --strict)
            path = target.split("#", 1)[0]
            if not (page.parent / path).resolve().exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_link_check_sees_links_and_skips_code():
    text = "see [a](a.md) and ![b](img/b.png)\n`[c](c.md)`\n```\n[d](d.md)\n```\n[e](https://x.org)"
    assert links(text) == ["a.md", "img/b.png", "https://x.org"]


def nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        for value in item.values():
            out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_the_nav_names_every_page_and_only_pages_that_exist():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    pages = nav_pages(config["nav"])
    written = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    missing = set(pages) - written
    assert not missing, f"in the nav but not in docs/: {missing}"
    assert written <= set(pages), f"in docs/ but not in the nav: {written - set(pages)}"
    assert len(pages) == len(set(pages))


@pytest.mark.parametrize("model, page", [(TrainConfig, "configuration_page"),
                                         (SFTConfig, "sft_configuration_page")])
def test_the_configuration_reference_lists_every_field(model, page):
    h = hooks()
    text = config_reference(model)
    fields = h.config_fields(text)
    headers = [line for line in text.splitlines()[2:] if line.strip() and not line.startswith(" ")]
    assert len(fields) == len(headers) > 30
    rendered = getattr(h, page)()
    for name, kind, description in fields:
        assert f"- **`{name}`** (`{kind}`)" in rendered, name
        if description:
            assert h._escape(" ".join(description)) in rendered, name
    for name in ("learning_rate", "off_policy.max_steps", "environments.<name>.num_rollouts"):
        assert name in {f[0] for f in fields} or model is SFTConfig


def test_the_cli_reference_covers_every_command(capsys):
    from polyrl import cli

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    usage = capsys.readouterr().out
    commands = re.search(r"\{([a-z,-]+)\}", usage).group(1).split(",")
    description = " ".join(usage.split("\n\n")[1].split())
    assert description == "polyrl: " + " | ".join(commands) + ".", "polyrl --help names every command"
    h = hooks()
    assert h.commands() == commands
    page = h.cli_page()
    for command in commands:
        assert f"## `polyrl {command}`" in page
        assert f"usage: polyrl {command}" in page
    assert "--max-request-tokens" in page  # polyrl serve's flags come from its own parser
    assert "usage: polyrl init-env" in page


def test_the_committed_reference_pages_are_what_the_code_gives():
    h = hooks()
    for path, function in h.GENERATED.items():
        committed = (DOCS / path).read_text(encoding="utf-8")
        assert committed == getattr(h, function)(), (
            f"docs/{path} differs from the code: run `{h.REGENERATE}` (or `make docs`) and commit it")


def test_a_stale_reference_page_stops_the_site_build(tmp_path, monkeypatch):
    from mkdocs.exceptions import PluginError

    h = hooks()
    (tmp_path / "reference").mkdir()
    for path, function in h.GENERATED.items():
        (tmp_path / path).write_text(getattr(h, function)(), encoding="utf-8")
    monkeypatch.setattr(h, "DOCS", tmp_path)
    h.on_pre_build(None)  # fresh pages build
    page = tmp_path / "reference" / "cli.md"
    page.write_text(page.read_text(encoding="utf-8").replace("polyrl init-env", "polyrl old-name"),
                    encoding="utf-8")
    with pytest.raises(PluginError, match=r"reference/cli\.md .*python docs/hooks\.py"):
        h.on_pre_build(None)
    assert h.main(["--check"]) == 1
    assert h.main([]) == 0 and h.stale_pages() == []  # rewritten
