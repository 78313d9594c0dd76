"""What ``trainguard validate`` says of a block before anything is launched: valid or not (exit 2, naming the key), what
it switches on, the framework it describes, and the keys each installed adapter would refuse at start
(trainguard.support.support.refusals) -- so that a block copied from one stack's example into another's is refused here,
not ~20 s into a launch."""
from __future__ import annotations

import sys

from trainguard import config as tg_config
from trainguard.errors import ConfigError


def validate(file: str, under: str | None = None) -> int:
    """``trainguard validate FILE [--under ADAPTER]``: the block parsed as the ranks will parse it, the modules it names
    found (never run), a line describing it for the framework it will run under, and what each installed adapter would
    refuse at start (``under``: exit 2 when that one refuses a key)."""
    from trainguard.support.prelaunch import check_imports
    from trainguard.support.support import adapters

    if under is not None and under not in adapters():
        print(f"--under {under!r}: not an installed adapter (one of: {', '.join(adapters())})", file=sys.stderr)
        return 2
    try:
        ds, block = tg_config.load(file)
        if block is not None:  # (and the modules of the callbacks, detectors and sinks it names found, not run)
            check_imports(block, source=file)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    if block is None:
        print(f"{file}: no \"trainguard\" block: DeepSpeed's own behaviour (nothing to validate)")
        return 0
    ds_keys = [k for k in ds if k != "trainguard"]  # (none: a block alone -- Megatron's --trainguard-config)
    nf = block.detectors.nonfinite
    on = [name for name in block.detectors_on() if name != "nonfinite"]  # (the banner's list: nonfinite said apart)
    parts = [
        "enabled" if block.enabled else "DISABLED",
        f"nonfinite={'on' if nf.enabled else 'off'}({nf.action}, grads {'checked' if nf.check_grads else 'not checked'})",
        f"detectors={'+'.join(on) or 'none'}",
        f"clipping={block.clipping.mode if block.clipping.mode != 'deepspeed' or ds_keys else 'the framework' + chr(39) + 's'}",
        f"checkpoints={block.checkpoint.saves()}",
        f"recovery={'on' if block.recovery.enabled else 'off'}",
        f"log={block.metrics.jsonl}{'+per-rank' if block.metrics.per_rank else ''}",
        f"faults={len(block.faults)}",
    ]
    zero = ds.get("zero_optimization", {}).get("stage", 0)
    enabled = {k: ds.get(k, {}).get("enabled") for k in ("bf16", "fp16")}
    dtype = "with the precision your trainer's arguments give ('auto')" if "auto" in enabled.values() else \
        "bf16" if enabled["bf16"] else "fp16" if enabled["fp16"] else "fp32"
    runs_as = f"DeepSpeed ZeRO-{zero} {dtype}" if ds_keys else (
        "a block alone, for Megatron-LM's --trainguard-config or your megatron-core loop: precision, parallel layout "
        "and clipping come from Megatron's own arguments")
    from trainguard.support.support import refusals

    refused = refusals(block)  # (what each adapter would refuse at start: said now, before a launch)
    print(f"{file}: {'REFUSED' if under in refused else 'OK'}: trainguard {', '.join(parts)}; {runs_as}")
    for adapter, why in refused.items():
        if under in (None, adapter):
            print(f"  refused under {adapter}: " + "; ".join(why))
    return 2 if under in refused else 0

