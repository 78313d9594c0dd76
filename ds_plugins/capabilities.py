"""What ds_plugins cannot honour, declared once (trainguard.support.support reads it through the ``trainguard.adapters``
entry point; ``initialize`` refuses a key set here by name). It runs under three names: ``ds_plugins``
(``initialize(training_data=...)``: trainguard's loader), ``ds_plugins/framework`` (the zero-code entry under HF
Trainer / Accelerate: their loader, tagged -- trainguard/data/sample_tags.py) and ``ds_plugins/own`` (``initialize`` without
training_data: your loader, which trainguard never sees). Its advice in the core's records and errors: ``HINTS``."""
from __future__ import annotations

from trainguard.ports import Refusal

VARIANTS = ("ds_plugins", "ds_plugins/framework", "ds_plugins/own")

_DATA = Refusal("shuffling, drop_last and the data position apply to the loader ds_plugins.initialize builds "
                "(pass training_data to it)")
_SKIP = Refusal("the loader is not trainguard's: a rollback cannot move it past the bad batches (it continues "
                "past the batches already seen); set 0", inert=(0,))
_OWN = ("your loader is not trainguard's, so trainguard never sees the samples: pass training_data to "
        "ds_plugins.initialize, or check them in your dataset")

# the core's advice on this adapter (trainguard.support.support.HINT_KEYS): your loader, or the Trainer's / Accelerate's
HINTS = {"sample_ids": "pass training_data to ds_plugins.initialize so that its loader names them"}
FRAMEWORK_HINTS = {
    "sample_ids": "the Trainer's or Accelerate's loader could not be tagged (run_start's untagged_loaders says why), or the "
                  "loop's forward was given none of a batch trainguard did not hand out",
    "refill": "in a loop of your own, pass training_data to ds_plugins.initialize: its loader refills batches"}

REFUSED: dict[str, dict[str, Refusal]] = {
    "sanitize.enabled": {"ds_plugins/own": Refusal(_OWN, inert=(False,))},
    "sanitize.": {"ds_plugins/own": Refusal(_OWN, inert=(None,))},
    "data.": {"ds_plugins/framework": _DATA, "ds_plugins/own": _DATA},
    "recovery.skip_batches": {"ds_plugins/framework": _SKIP, "ds_plugins/own": _SKIP},
    "checkpoint.snapshot.every_steps": {"ds_plugins/framework": Refusal(
        "Hugging Face's Trainer and Accelerate resume from their own checkpoint-N folders (their trainer state, "
        "scheduler and data position), which a shard in memory cannot stand in for", inert=(0,))},
}
