"""Fault injection, config-driven: what goes wrong in real runs, at step k on rank r (``injector``), the faults that act
through the model (``module_faults``) and a token batch's poison (``poison``).

May import trainguard.ranks and trainguard.config.
"""
