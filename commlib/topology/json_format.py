"""JSON writer (the reader is registered in formats.py)."""

from .formats import read_json, write_json

__all__ = ["read_json", "write_json"]
