"""Command-line interface (``piper``)."""
