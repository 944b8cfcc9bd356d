"""Lossless compression of tensor bytes: byte-grouping (``grouping``), the CPU codecs
(``codecs``), a tensor as independent chunks on the CPU (``chunks``) and on the GPU (``gpu``).
Not yet used by save or load: docs/format.md ("Compressed tensors") is the plan."""
