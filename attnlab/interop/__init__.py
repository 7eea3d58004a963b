"""Checkpoints of other libraries: `hf` imports and exports Hugging Face GPT-2 and BERT models."""
