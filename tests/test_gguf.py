"""GGUF import: bad input gets one-line errors (the real file is imported in test_real_model.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.errors import UserInputError
from polyrl.models import resolve_model_path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyrl.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "does not exist"),
        (b"", "is not a GGUF file"),
        (b"PK\x03\x04 a zip, not a model", "is not a GGUF file"),
        # the magic, a version, then the header cut short
        (b"GGUF\x03\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00\x02", "could not be imported"),
    ],
    ids=["missing", "empty", "other-format", "truncated"],
)
def test_import_gguf_rejects_bad_files_in_one_line(tmp_path, content, problem):
    source = tmp_path / "model.gguf"
    if content is not None:
        source.write_bytes(content)
    out = run_cli("import-gguf", str(source), str(tmp_path / "out"))
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and problem in lines[0], out.stderr
    assert not (tmp_path / "out").exists()
    # no temp dirs
    assert [p.name for p in tmp_path.iterdir()] == (["model.gguf"] if content is not None else [])


def test_import_gguf_does_not_write_into_a_non_empty_directory(tmp_path):
    from polyrl.models.gguf import import_gguf

    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserInputError, match="not empty"):
        import_gguf(source, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_model_name_naming_a_gguf_file_is_checked(tmp_path):
    with pytest.raises(UserInputError, match="no such GGUF file"):
        resolve_model_path(str(tmp_path / "absent.gguf"))
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(UserInputError, match="not a GGUF file"):
        resolve_model_path(str(not_gguf))


def test_packaged_model_and_sizes_are_listed_in_errors(tmp_path):
    out = run_cli("tiny-model", str(tmp_path / "x"), "--size", "no-such-size")
    assert out.returncode == 2
    assert "smollm2-135m-instruct" in out.stderr and "qwen3-0.6b" in out.stderr
    assert not Path(tmp_path / "x").exists()
