"""The data: a resumable, sample-id-aware position and loader (``position``), sample ids for loaders a framework
builds (``sample_tags``), and the batch sanitiser that checks every sample before it reaches the model
(``sanitize``: the *prevent* line's data half).

May import trainguard.config and trainguard.errors.
"""
