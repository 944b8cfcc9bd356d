"""The file format: the header codec, the structure JSON, flattening a state, slices of a stored
tensor (docs/format.md)."""
