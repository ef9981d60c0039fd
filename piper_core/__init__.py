"""Piper core: specs -> resource model -> scheduler -> runtime all-to-all.

Importing ``piper_core`` (and its specs and resource model) never imports torch; only
``piper_core.runtime`` does.
"""

__version__ = "0.1.0"
