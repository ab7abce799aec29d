"""Checkpoints: the store (layout, scan, commit records; torch-free), save, load, safe loading, export."""
