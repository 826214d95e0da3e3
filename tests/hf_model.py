"""A tiny random Hugging Face causal LM folder, built offline: what tests use for "any HF model".

Unlike the built-in tiny policy (a Qwen2 with a character tokenizer and ChatML), this is a Llama
with a word-level tokenizer, a chat template of another shape and no pad token (as Llama's own
tokenizer has none), saved with ``save_pretrained`` the way a downloaded model folder looks.
Nothing is downloaded: the vocabulary, the template and the weights are made here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
WORDS = (
    "user assistant system : what is the answer to hello yes no a an and or of "
    "zero one two three four five six seven eight nine ten plus minus equals question please"
).split()
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<s> {{ message['role'] }} : {{ message['content'] }} </s> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


def build_hf_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer (ids 0-2 special) with a chat template and no pad token."""
    vocab = {token: i for i, token in enumerate([BOS, EOS, UNK, *dict.fromkeys(WORDS)])}
    core = Tokenizer(WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece()  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, unk_token=UNK, model_max_length=256
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_hf_model_folder(folder: Path, *, seed: int = 0) -> Path:
    """Write a random two-layer Llama (hidden size 32) and its tokenizer to ``folder``; return it."""
    tokenizer = build_hf_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
