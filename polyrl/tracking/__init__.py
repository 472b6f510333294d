"""Run tracking: files in log_path, the console, Weights & Biases."""
