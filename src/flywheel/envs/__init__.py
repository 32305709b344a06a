"""Environments and their tasks."""
