"""The demo: a small GPT-style model on a deterministic corpus, trained under torchrun.

Part of trainguard's "face" (with cli.py): the only place in the core package allowed to import the
adapters, and only inside the worker process.

May import trainguard.bootstrap, trainguard.observe, trainguard.metrics, trainguard.config and the vocabulary (and,
in its worker only, the DeepSpeed adapter: .importlinter names that import).
"""
