"""A word-level tokenizer built in memory (no downloads) whose ids fit the tiny models' vocab_size=256."""
from __future__ import annotations

import string

WORDS = ("the quick brown fox jumps over a lazy dog and then it runs to the river where many small fish "
         "swim in cold water while birds sing on old trees near the hill").split()


def make_tiny_tokenizer():
    """[UNK], [PAD], the words above and single characters: well under 256 ids."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1}
    for token in [*WORDS, *string.ascii_lowercase, *string.digits, *".,;:!?'\"()-"]:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


def byte_bpe_tokenizer():
    """A byte-level BPE trained in memory on the tiny word list: fewer ids than the tiny models' 256 rows."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def word_text(n_words: int) -> str:
    """`n_words` words of the vocabulary, cycled, as one line."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(n_words))
