"""Data in: load a dataset (name, path, hub id), its columns and labels, tokenize, partition."""
