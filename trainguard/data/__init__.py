"""The data: a resumable, sample-id-aware position and loader (``position``), sample ids for loaders a framework
builds (``sample_tags``), and the batch sanitiser that checks every sample before it reaches the model
(``sanitize``: the *prevent* line's data half).

May import trainguard.config and trainguard.errors.
"""

_POSITION = ("DataPosition", "ShardedSampler", "TrackedLoader", "merge_positions")


def __getattr__(name):  # (``from trainguard.data import TrackedLoader``: what ds_plugins.initialize hands back, by
    if name in _POSITION:  # its name from before the rooms; imported on first use)
        from trainguard.data import position

        return getattr(position, name)
    raise AttributeError(f"module 'trainguard.data' has no attribute {name!r}")
