"""Issue 33, 3 and 4, through a real decode node and the real openai client: logprobs equal
mlx-lm's own log-probabilities; penalties and logit_bias give mlx-lm's own tokens through its
logits processors; what the node does not do is a 400 naming the field; a model whose weights
give non-finite logits answers an error, never a 200 with empty text."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import openai
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_logits_processors

from tests.conftest import MakeTiny
from tests.nodeproc import start_node
from tests.openai_support import all_healthy, openai_client

TOKEN = "openai-fields-token-0123456789"
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64]  # token ids: no template between us and mlx-lm


@pytest.fixture(scope="module")
def nodes(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(model dir, a node serving it, a node serving a copy whose last 4000 bytes are 0xff
    and whose tokenizer has no chat template, as a base model's)."""
    model = tiny_model()
    tmp = tmp_path_factory.mktemp("openai-fields")
    broken = tmp / "broken"
    shutil.copytree(model, broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.seek(-4000, 2)
        f.write(b"\xff" * 4000)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    (broken / "chat_template.jinja").unlink(missing_ok=True)
    args = ("--remote-prefill", "never")
    good = start_node(tmp, model, "decode", *args, token=TOKEN, wait=False)
    bad = start_node(tmp, broken, "decode", *args, token=TOKEN, wait=False)
    with all_healthy(good, bad):
        yield model, good, bad


def _mlx(model: Path, n: int, **processors: Any) -> list[Any]:
    """mlx-lm's own greedy responses for PROMPT, through its own logits processors."""
    m, tokenizer = load(str(model))
    return list(
        stream_generate(
            m, tokenizer, mx.array(PROMPT), max_tokens=n,
            logits_processors=make_logits_processors(**processors),
        )
    )  # fmt: skip


def test_logprobs_are_mlx_lms_own(nodes: Any) -> None:
    model, good, _ = nodes
    reply = openai_client(good).completions.create(
        model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    want = _mlx(model, 6)
    lp = reply.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == len(want)
    for got, response, top in zip(lp.token_logprobs, want, lp.top_logprobs, strict=True):
        assert got == pytest.approx(response.logprobs[response.token].item(), abs=1e-4)
        assert len(top) == 3 and max(top.values()) == pytest.approx(got, abs=1e-4)  # greedy
    assert reply.choices[0].text == "".join(r.text for r in want)


def test_chat_logprobs_shape(nodes: Any) -> None:
    _, good, _ = nodes
    reply = openai_client(good).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


@pytest.mark.parametrize(
    "fields",
    [
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"presence_penalty": -2.0},
        {"logit_bias": {"77": 100}},
    ],
    ids=["penalties", "negative-presence", "logit-bias"],
)
def test_penalties_and_bias_are_mlx_lms_processors(nodes: Any, fields: dict[str, Any]) -> None:
    model, good, _ = nodes
    reply = openai_client(good).completions.create(
        model="m", prompt=PROMPT, max_tokens=8, temperature=0, **fields
    )
    bias = {int(k): float(v) for k, v in fields.get("logit_bias", {}).items()} or None
    want = _mlx(
        model, 8, logit_bias=bias, presence_penalty=fields.get("presence_penalty"),
        frequency_penalty=fields.get("frequency_penalty"),
    )  # fmt: skip
    assert reply.choices[0].text == "".join(r.text for r in want)
    if "frequency_penalty" not in fields:  # a random model seldom repeats: nothing to damp
        plain = openai_client(good).completions.create(
            model="m", prompt=PROMPT, max_tokens=8, temperature=0
        )
        assert plain.choices[0].text != reply.choices[0].text  # the fields did something


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"response_format": {"type": "json_object"}},
    ],
    ids=["tools", "json"],
)
def test_what_the_node_does_not_do_is_a_400_naming_it(nodes: Any, extra: dict[str, Any]) -> None:
    _, good, _ = nodes
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(good).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], **extra
        )
    assert e.value.code == "unsupported_field"
    assert next(iter(extra)) in e.value.message


def test_non_finite_logits_are_an_error_not_an_empty_answer(nodes: Any) -> None:
    _, _, bad = nodes
    with pytest.raises(openai.InternalServerError) as e:
        openai_client(bad).completions.create(model="m", prompt=PROMPT, max_tokens=4)
    assert "non-finite" in e.value.message
    stream = openai_client(bad).completions.create(
        model="m", prompt=PROMPT, max_tokens=4, stream=True
    )
    with pytest.raises(openai.APIError, match="non-finite"):
        for _ in stream:
            pass


def test_chat_on_a_model_without_a_chat_template_is_a_clear_400(nodes: Any) -> None:
    _, _, base = nodes
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(base).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert e.value.code == "no_chat_template"
    assert "/v1/completions" in e.value.message
