"""Megatron-LM's pretrain_gpt.py with trainguard: run it from your Megatron-LM checkout.

    torchrun ... scripts/megatron/pretrain_gpt_trainguard.py <pretrain_gpt arguments> \\
        --trainguard-config trainguard.json

It imports ``pretrain_gpt`` from the Megatron-LM checkout on ``PYTHONPATH`` (its providers and
forward step, unchanged), wraps ``megatron.training.training.setup_model_and_optimizer`` so that
``megatron_hooks.install`` guards the model chunks and the optimizer it returns (from the resumed
iteration on), and calls ``pretrain`` with ``megatron_hooks.extra_args_provider`` added -- so the
``--trainguard-config`` argument exists and is validated at parse time.

Written against Megatron-LM's core_r0.16 layout (``megatron/training/training.py``); Megatron-LM
is not pip-installable, so this launcher is not exercised by trainguard's tests (the argument
extension is). Without ``--trainguard-config`` it is plain pretrain_gpt.
"""
from __future__ import annotations

import atexit


def main() -> None:
    import pretrain_gpt  # Megatron-LM's, from the checkout on PYTHONPATH
    from megatron.training import get_args, training

    import megatron_hooks

    original = training.setup_model_and_optimizer

    def setup_model_and_optimizer(*args, **kwargs):
        model, optimizer, scheduler = original(*args, **kwargs)
        margs = get_args()
        if getattr(margs, "trainguard_config", None):
            guard = megatron_hooks.install(model, optimizer, margs.trainguard_config,
                                           start_iteration=int(getattr(margs, "iteration", 0) or 0))
            atexit.register(guard.close)
        return model, optimizer, scheduler

    training.setup_model_and_optimizer = setup_model_and_optimizer
    extra = getattr(pretrain_gpt, "add_modelopt_args", None)

    def extra_args(parser):
        parser = megatron_hooks.extra_args_provider(parser)
        return extra(parser) if extra is not None else parser

    from megatron.core.enums import ModelType

    training.pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                      ModelType.encoder_or_decoder, pretrain_gpt.forward_step,
                      args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, extra_args_provider=extra_args)


if __name__ == "__main__":
    main()
