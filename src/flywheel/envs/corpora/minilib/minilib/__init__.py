"""minilib: small, dependency-free helpers (intervals, roman numerals, stacks and queues,
an arithmetic tokenizer, text and number utilities)."""

__version__ = "1.0.0"
