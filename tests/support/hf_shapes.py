"""A user's Hugging Face script, opening with each import the zero-code entry must survive (issue 32):
``[trainguard run --] torchrun --nproc_per_node 2 -m tests.support.hf_shapes --shape SHAPE <hf_worker's arguments>``.

The shape's import is this module's first statement, before anything of the tests' or of trainguard's:
under ``trainguard run`` the zero-code entry loads in the middle of it (Accelerate's import inside
``transformers.trainer``, say). Then the run is tests/support/hf_worker.py's (HF's ``Trainer``; TRL's
``SFTTrainer`` for the ``trl`` shape)."""
import sys

SHAPE = None
if __name__ == "__main__" and "--shape" in sys.argv:
    SHAPE = sys.argv.pop(sys.argv.index("--shape") + 1)
    sys.argv.remove("--shape")
SHAPES = ("trainer_first", "transformers_attribute", "training_arguments_first", "accelerate_first", "deepspeed_first",
          "trl")

if SHAPE == "trainer_first":
    from transformers import Trainer, TrainingArguments  # noqa: F401
elif SHAPE == "transformers_attribute":
    import transformers

    transformers.Trainer  # noqa: B018 - the lazy module imports transformers.trainer here
elif SHAPE == "training_arguments_first":
    from transformers import TrainingArguments  # noqa: F401
elif SHAPE == "accelerate_first":
    import accelerate  # noqa: F401
elif SHAPE == "deepspeed_first":
    import deepspeed  # noqa: F401
elif SHAPE == "trl":
    from trl import SFTConfig, SFTTrainer
elif SHAPE is not None:
    raise SystemExit(f"unknown shape {SHAPE!r}")

from tests.support.hf_worker import main  # noqa: E402


def sft_trainer(model, targs, dataset, callbacks):
    """TRL's SFTTrainer over the same data (float embeddings, labels; no downloads: a word-level tokenizer built
    here; the samples in a ``datasets.Dataset``, which SFTTrainer requires, used as they are and stacked by the
default collator)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, default_data_collator

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]")),
                                        pad_token="[PAD]", eos_token="[PAD]")
    fields = {k: v for k, v in targs.to_dict().items() if k in SFTConfig.__dataclass_fields__ and not k.startswith("_")}
    import datasets

    dataset = datasets.Dataset.from_dict({"inputs_embeds": dataset.x.numpy(), "labels": dataset.y.numpy(),
                                        "attention_mask": (dataset.y >= 0).long().numpy()})  # (SFTTrainer's metrics need it)
    sargs = SFTConfig(**{**fields, "dataset_kwargs": {"skip_prepare_dataset": True}, "remove_unused_columns": False})
    return SFTTrainer(model=model, args=sargs, train_dataset=dataset.with_format("torch"), processing_class=tokenizer,
                      data_collator=default_data_collator, callbacks=callbacks)


if __name__ == "__main__":
    sys.exit(main(make_trainer=sft_trainer if SHAPE == "trl" else None))
