"""export_hf: a checkpoint's model as a Hugging Face folder (its plan, sources and copier)."""
