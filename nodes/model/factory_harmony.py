"""The Harmony tokenizer of made gpt-oss models: byte-level BPE (factory_tokenizer.py) with
gpt-oss's message markers as special tokens, and a small chat template that writes a
conversation in Harmony, as gpt-oss's own template does in outline:

    <|start|>system<|message|>Be brief.<|end|>
    <|start|>developer<|message|># Tools ... namespace functions { ... }<|end|>
    <|start|>user<|message|>Weather in Paris?<|end|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{...}<|call|>
    <|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|end|>
    <|start|>assistant                                   <- the generation prompt

(one line each here; the template writes no newlines between messages). The tools, where a
request gives them, are a developer message after the system message (or first, without one).
A tool's answer names its function by the id of the call it answers. gpt-oss's own template
also writes the model identity, reasoning effort and valid channels into the system message;
a made model has no use for them.

The special tokens take ids 0..7 in `HARMONY_SPECIAL_TOKENS`' order (the trainer puts them
first). A reply ends in `<|return|>` or, a tool call, in `<|call|>`: both belong in the
generation config's `eos_token_id` list, with `<|endoftext|>` (gpt-oss's own lists all three).
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.factory_tokenizer import train_tokenizer

HARMONY_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|start|>", "<|return|>", "<|end|>", "<|message|>", "<|channel|>",
    "<|constrain|>", "<|call|>",
)  # fmt: skip
HARMONY_EOS_TOKENS = ("<|return|>", "<|call|>", "<|endoftext|>")  # where a reply ends
# The Jinja source keeps every literal in a string expression, so its own line breaks (and
# the blocks' whitespace) never reach the prompt; "\\n" is a newline in the prompt.
HARMONY_CHAT_TEMPLATE = (
    "{%- set ns = namespace(name='') -%}"
    "{%- macro tool_list() -%}"
    "{{- '<|start|>developer<|message|># Tools\\n\\n## functions\\n\\n'"
    " + 'namespace functions {\\n\\n' -}}"
    "{%- for tool in tools -%}"
    "{%- set f = tool.function if tool.function is defined else tool -%}"
    "{%- if f.description -%}{{- '// ' + f.description + '\\n' -}}{%- endif -%}"
    "{{- 'type ' + f.name + ' = (_: ' + (f.parameters or {}) | tojson + ') => any;\\n\\n' -}}"
    "{%- endfor -%}"
    "{{- '} // namespace functions<|end|>' -}}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message.role != 'system' -%}{{- tool_list() -}}{%- endif -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- if message.content -%}"
    "{%- set channel = 'commentary' if message.tool_calls else 'final' -%}"
    "{{- '<|start|>assistant<|channel|>' + channel + '<|message|>' + message.content"
    " + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{%- set args = f.arguments if f.arguments is string else f.arguments | tojson -%}"
    "{{- '<|start|>assistant to=functions.' + f.name + '<|channel|>commentary json<|message|>'"
    " + args + '<|call|>' -}}"
    "{%- endfor -%}"
    "{%- elif message.role == 'tool' -%}"
    "{%- set ns.name = 'unknown' -%}"
    "{%- for m in messages if m.role == 'assistant' and m.tool_calls -%}"
    "{%- for call in m.tool_calls if call.id is defined and call.id == message.tool_call_id -%}"
    "{%- set ns.name = call.function.name if call.function is defined else call.name -%}"
    "{%- endfor -%}{%- endfor -%}"
    "{{- '<|start|>functions.' + ns.name + ' to=assistant<|channel|>commentary<|message|>'"
    " + message.content + '<|end|>' -}}"
    "{%- else -%}"
    "{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- if tools and loop.first and message.role == 'system' -%}{{- tool_list() -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)


def write_harmony_tokenizer(out: Path, vocab: int, max_positions: int) -> tuple[int, int, int]:
    """Train and write `tokenizer.json` and `tokenizer_config.json` (the Harmony specials and
    chat template, `<|return|>` as eos) into `out`; the ids of (`<|start|>`, unused as a bos,
    `<|endoftext|>`, `<|return|>`)."""
    tokenizer_json = train_tokenizer(vocab, HARMONY_SPECIAL_TOKENS)
    ids = json.loads(tokenizer_json)["model"]["vocab"]
    if [ids[t] for t in HARMONY_SPECIAL_TOKENS] != list(range(len(HARMONY_SPECIAL_TOKENS))):
        raise ModelError("the tokenizer trainer did not put the Harmony tokens first")
    (out / "tokenizer.json").write_text(tokenizer_json)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions,
        "chat_template": HARMONY_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return ids["<|start|>"], ids["<|endoftext|>"], ids["<|return|>"]
