"""Data: sources, segmentation, training objectives, tokenization, GSM-Symbolic instances."""
