"""Adapters for training frameworks, each imported on its own (never by the core)."""
