"""Potluck: pool the computers you already own to run one local LLM."""

__version__ = "0.1.0"
