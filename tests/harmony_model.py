"""A made model that replies in Harmony: the successor machine of tests/tools_model.py on a
tiny llama with the Harmony tokenizer (factory_harmony.py), so a greedy reply to any chat is
the given pieces in order.

A successor machine maps each token to one next token, so no token may come twice in a reply;
a Harmony reply repeats its markers (`<|channel|>` in each header). A later header is
therefore one added token holding the whole header's text: the text the detokenizer gives is
what gpt-oss's separate marker tokens give. The chain starts from the generation prompt's last
token (`<|start|>assistant`'s) and must end in an eos (`<|return|>` or `<|call|>`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tandem.nodes.model.factory import MakeModelArgs, make_model
from tandem.nodes.model.factory_harmony import (
    HARMONY_EOS_TOKENS,
    HARMONY_SPECIAL_TOKENS,
    write_harmony_tokenizer,
)

from tests.tools_model import _write_weights

ANSWER = [  # analysis, then the final answer
    "<|channel|>", "analysis", "<|message|>", "Thinking.", "<|end|>",
    "<|start|>assistant<|channel|>final<|message|>", "Hello!", "<|return|>",
]  # fmt: skip
CALL = [  # analysis, then a call (the recipient after the channel, <|constrain|>json)
    "<|channel|>", "analysis", "<|message|>", "Thinking.", "<|end|>",
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    "<|message|>", '{"city":"Paris"}', "<|call|>",
]  # fmt: skip


def make_harmony_model(out: Path, reply: Sequence[str]) -> Path:
    """The model in `out` whose greedy reply to a chat is `reply` (each piece a Harmony
    special token or one added token)."""
    from tokenizers import AddedToken, Tokenizer

    args = MakeModelArgs(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128)
    make_model(out, args)
    write_harmony_tokenizer(out, args.vocab, args.max_position_embeddings)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    added = [p for p in reply if p not in HARMONY_SPECIAL_TOKENS]
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in added])
    tok.save(str(out / "tokenizer.json"))
    chain = [tok.encode("<|start|>assistant").ids[-1], *(tok.token_to_id(p) for p in reply)]
    assert None not in chain and len(set(chain)) == len(chain), chain
    eos = [tok.token_to_id(t) for t in HARMONY_EOS_TOKENS]
    assert chain[-1] in eos, reply[-1]
    generation = {"eos_token_id": eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation))
    vocab = tok.get_vocab_size()
    config = json.loads((out / "config.json").read_text())
    config.update(vocab_size=vocab, tie_word_embeddings=False, eos_token_id=eos[0])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(out, args, vocab, chain)
    return out
