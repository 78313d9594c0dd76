"""The demo: a small GPT-style model on a deterministic corpus, trained under torchrun.

Part of trainguard's "face" (with cli.py): the only place in the core package allowed to import the
adapters, and only inside the worker process.
"""
