"""A made model that calls a tool: a tiny llama rewritten into a successor machine.

Random weights never emit a tool call, so this one is built to: every layer's output
projections (`o_proj`, `down_proj`) are zero, so the residual stream at the last layer is the
token's own embedding; each embedding row has the same norm (sqrt(hidden): the final RMS norm,
all ones, leaves it as it is), and `lm_head` row s(t) is embedding row t. Greedy decoding then
maps token t to s(t), whatever came before it. The chain from the chat template's last token:

    "\\n" -> "<tool_call>" -> CALL -> "</tool_call>" -> "<|im_end|>" (eos)

where CALL is one added token holding the whole JSON call. The chat template is in the
json_tools style mlx-lm infers (it names "<tool_call>" and `tool_call.name`).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
from tandem.nodes.model.factory import MakeModelArgs, make_model
from tandem.nodes.model.safetensors_format import RawTensor, encode, float_bytes

CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'  # no spaces: byte-level safe
ADDED = ("<tool_call>", CALL, "</tool_call>")
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool | tojson }}"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content or '' }}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    '{%- endif %}<tool_call>{"name":"{{ tool_call.name }}","arguments":'
    "{{ tool_call.arguments | tojson }}}</tool_call>{%- endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>tool\n{{ message.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LOGIT_SCALE = 4.0  # lm_head rows are this times the embedding: the chain wins by a wide margin


def make_tools_model(out: Path) -> Path:
    """The successor-machine model in `out` (float32)."""
    from tokenizers import AddedToken, Tokenizer

    args = MakeModelArgs(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128)
    make_model(out, args)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.save(str(out / "tokenizer.json"))
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**tok_config, "chat_template": TEMPLATE}, indent=2))

    newline = tok.encode("\n").ids
    assert len(newline) == 1, newline
    chain = [newline[0], *(tok.token_to_id(t) for t in ADDED), tok.token_to_id("<|im_end|>")]
    assert len(set(chain)) == len(chain), chain
    vocab = tok.get_vocab_size()
    config = json.loads((out / "config.json").read_text())
    config.update(vocab_size=vocab, tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(out, args, vocab, chain)
    return out


def _write_weights(out: Path, args: MakeModelArgs, vocab: int, chain: list[int]) -> None:
    """Rewrite the made weights: zero output projections, equal-norm embeddings, and a head
    whose row chain[i + 1] is embedding row chain[i]."""
    from safetensors.numpy import load_file

    weights = load_file(str(out / "model.safetensors"))
    rng = np.random.default_rng(1)
    h = args.hidden
    embed = rng.standard_normal((vocab, h)).astype(np.float32)  # [V, H]
    embed *= np.float32(h**0.5) / np.linalg.norm(embed, axis=1, keepdims=True)
    head = 0.5 * embed  # a token outside the chain goes to itself
    for t, s in itertools.pairwise(chain):
        head[s] = embed[t]
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = LOGIT_SCALE * head
    weights["model.norm.weight"] = np.ones(h, np.float32)
    for name in weights:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = np.zeros_like(weights[name])
    tensors = {}
    for name, array in weights.items():
        dtype, data = float_bytes(array, "float32")
        tensors[name] = RawTensor(dtype, tuple(array.shape), data)
    (out / "model.safetensors").write_bytes(encode(tensors, {"format": "pt"}))
