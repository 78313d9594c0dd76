"""What is supported and what a block asks for, told before anything runs: the release matrix (``releases``), which
adapter honours which key (``support``), ``trainguard validate`` (``validate``), what ``trainguard run`` checks before
launching (``prelaunch``), and the config's generated documents (``reference``: ``python -m
trainguard.support.reference``).

May import trainguard.plugins, trainguard.config and trainguard.errors.
"""
