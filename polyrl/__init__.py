"""polyrl: reinforcement-learning fine-tuning of language models on many environments at once."""

__version__ = "0.1.0"

import os as _os
import warnings as _warnings

_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Library chatter that says nothing actionable to a polyrl user.
_warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
_warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
_warnings.filterwarnings("ignore", message=".*save_embedding_layers.*")
try:  # transformers' per-load progress bars
    from transformers.utils import logging as _hf_logging

    _hf_logging.disable_progress_bar()
except ImportError:  # pragma: no cover
    pass

from polyrl.secrets import redact_logs as _redact_logs  # noqa: E402 - after the warning filters above

_redact_logs()  # whatever any code logs or warns in a polyrl process has API keys masked
