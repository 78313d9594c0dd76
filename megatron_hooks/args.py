"""The argument trainguard adds to Megatron-LM's parser: ``--trainguard-config FILE``, validated at parsing."""
from __future__ import annotations

import argparse
from pathlib import Path

from megatron_hooks.capabilities import REFUSED
from trainguard import config as tg_config
from trainguard.errors import UnsupportedSetup
from trainguard.ports import check_supported, releases


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """For Megatron-LM's ``pretrain(..., extra_args_provider=...)``: adds ``--trainguard-config``
    (once: ``trainguard run`` adds it to every Megatron-LM parser already, megatron_hooks.lm)."""
    if "--trainguard-config" in getattr(parser, "_option_string_actions", {}):
        return parser
    group = parser.add_argument_group(title="trainguard")
    group.add_argument("--trainguard-config", type=_existing_file, default=None, metavar="FILE",
                       help="JSON file with the trainguard block (or a ds_config-style file holding one); the "
                            "block is validated here, so a bad key stops the launch at once")
    return parser


def _existing_file(value: str) -> str:
    path = Path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"--trainguard-config: {value} is not a file")
    try:
        check_supported(tg_config.block_of(str(path)), "megatron_hooks", REFUSED)
        import megatron.core

        releases.check("megatron-lm", megatron.core.__version__)  # (Megatron-LM's loop: its own row of the matrix)
    except UnsupportedSetup as e:
        raise argparse.ArgumentTypeError(f"--trainguard-config: {e}") from None
    except tg_config.ConfigError as e:
        raise argparse.ArgumentTypeError(f"--trainguard-config {value}: {e}") from None
    return str(path)
