"""What the stand-in training scripts saw when they started (read by tests/megatron/args_driver.py)."""

starts: list[list[str]] = []  # per script run: the megatron modules already imported at its start
