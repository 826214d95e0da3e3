"""The tiny policy model: tokenizer, model, checkpoints and sampling (torch only, no I/O roles)."""

from agl_stream.policy.model import (
    ALPHABET,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    UNK_TOKEN,
    Generation,
    StepToken,
    build_model,
    build_tokenizer,
    eos_token_ids,
    generate,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "ALPHABET",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IM_START_TOKEN",
    "PAD_TOKEN",
    "UNK_TOKEN",
    "Generation",
    "StepToken",
    "build_model",
    "build_tokenizer",
    "eos_token_ids",
    "generate",
    "load_checkpoint",
    "save_checkpoint",
]
