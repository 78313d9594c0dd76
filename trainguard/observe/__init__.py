"""What the run says: the event log and its one vocabulary of records (``eventlog``, ``records``, ``steplog``), alerts as
incidents (``incidents``), goodput (``goodput``), and what people read afterwards (``summary``, ``report``). The sinks
that carry the records are trainguard.metrics.

May import trainguard.plugins (user sinks and callbacks), trainguard.metrics, trainguard.ranks, trainguard.config and the
vocabulary.
"""
