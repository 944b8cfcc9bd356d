"""Lossless compression of tensor bytes: byte-grouping (``grouping``) and the CPU codecs
(``codecs``). Not yet used by save or load: docs/format.md ("Compressed tensors") is the plan."""
