"""Evaluation: decoding, answer grading, evaluating a model on a set."""
