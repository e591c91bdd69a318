"""The made models' tokenizer: byte-level BPE trained with `tokenizers` on the committed
`assets/corpus.txt`, one trainer for every set of special tokens (factory.py's ChatML ones,
factory_harmony.py's Harmony ones). The trainer gives the special tokens the first ids, in the
order given; the same arguments give byte-identical text.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[2] / "assets" / "corpus.txt"


def train_tokenizer(vocab: int, specials: Sequence[str]) -> str:
    """Byte-level BPE of `vocab` tokens (`specials` ids 0..len - 1); tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.read_text().splitlines(), trainer)
    return tok.to_str(pretty=True)
