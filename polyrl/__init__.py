"""polyrl: reinforcement-learning fine-tuning of language models on many environments at once."""

__version__ = "0.1.0"
