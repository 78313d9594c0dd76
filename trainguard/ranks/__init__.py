"""Every rank's coordinates and the values they exchange: the AGREE row's fields and the collectives that combine them
(``isolation``), the fixed-size summary of a large world (``reduced``), the culprit ranks read off them
(``attribution``), the bits ranks compare (``bits``), which attempt of the job this is (``attempt``), this process's
sockets (``sockets``).

May import only the vocabulary: trainguard.events, trainguard.verdicts, trainguard.decisions.
"""
