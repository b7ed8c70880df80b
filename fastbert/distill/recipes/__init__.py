"""Runnable distillation recipes (`python -m fastbert.distill.recipes.<name>`)."""
