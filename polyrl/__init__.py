"""polyrl: reinforcement-learning fine-tuning of language models on many environments at once."""

__version__ = "0.1.0"

import os as _os
import sys as _sys
import warnings as _warnings

_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Library chatter that says nothing actionable to a polyrl user.
_warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
_warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
_warnings.filterwarnings("ignore", message=".*save_embedding_layers.*")
# transformers' and the hub's per-load progress bars: read from the environment when the hub is imported
# (importing transformers here would cost every command, even one that only reports a mistake, ~1 s)
if "transformers" in _sys.modules or "huggingface_hub" in _sys.modules:
    from transformers.utils import logging as _hf_logging

    _hf_logging.disable_progress_bar()
else:
    _os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from polyrl.secrets import redact_logs as _redact_logs  # noqa: E402 - after the warning filters above

_redact_logs()  # whatever any code logs or warns in a polyrl process has API keys masked
