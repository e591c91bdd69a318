"""Quantized KV on the wire (issue 20), end to end: a decode node that builds mlx-lm
QuantizedKVCaches from a prefill node's frames; greedy tokens equal to mlx-lm's own
`generate(kv_bits=N, quantized_kv_start=0)`; bad formats refused. The frames themselves are
in test_quantized_kv_frames.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import openai
import pytest
from tandem.nodes.contract.bodies import PrefillBody
from tandem.nodes.contract.frames import Header, LayerFrame
from tandem.nodes.contract.http import PROTO, KVFormat
from tandem.nodes.model import fingerprint, load_index

from tests.conftest import MakeTiny
from tests.nodeproc import NodeProc, remote_pair, start_node
from tests.records import stats_of
from tests.test_wire import decode_all

TOKEN = "quant-token-0123456789"
PROMPTS = ["Tell me a story about a lighthouse keeper.", "Why is the sky blue?"]
MAX_TOKENS = 16


# ---------------------------------------------------------------- end to end


class Pair:
    def __init__(self, model: Path, prefill: NodeProc, decode: NodeProc) -> None:
        from mlx_lm import load

        self.model, self.prefill, self.decode = model, prefill, decode
        self.mlx_model, self.tokenizer = load(str(model))

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.decode.url + "/v1", api_key=TOKEN)

    def tokens(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def reference(self, messages: list[dict[str, str]], bits: int | None, group: int = 64) -> str:
        """mlx-lm's greedy text, its cache quantized after the prompt (`bits` None: float)."""
        from mlx_lm import generate

        kv = {"kv_bits": bits, "kv_group_size": group, "quantized_kv_start": 0} if bits else {}
        return generate(
            self.mlx_model, self.tokenizer, self.tokens(messages), max_tokens=MAX_TOKENS, **kv
        )


@pytest.fixture(scope="module")
def pair(tiny_model: MakeTiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    model = tiny_model(arch="llama", layers=4, hidden=64, heads=2, kv_heads=1, head_dim=64)
    with remote_pair(tmp_path_factory.mktemp("qkv"), model, "200KB", TOKEN) as (p, d):
        yield Pair(model, p, d)


def _chat(pair: Pair, messages: list[dict[str, str]], bits: int, group: int | None = None):
    fmt = {"kv_bits": bits} | ({"kv_group_size": group} if group else {})
    return pair.client().chat.completions.create(
        model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"tandem": fmt},
    )  # fmt: skip


# the last one's greedy text shows a 4-bit cache (group 64) on the test model
GREEDY_PROMPTS = [*PROMPTS, "What is the capital of France? Answer briefly."]


@pytest.mark.parametrize(("bits", "group"), [(8, 64), (4, 64), (4, 32), (8, 32)])
def test_remote_quantized_prefill_is_mlx_lms_quantized_greedy(
    pair: Pair, bits: int, group: int
) -> None:
    """Greedy text after a remote prefill in each format equals mlx-lm's own generation with
    that `kv_bits` and `kv_group_size` from scratch. At 4 bits the test can tell: some prompt's
    4-bit text differs from the float one. (8-bit KV does not move greedy text on this model:
    the wire's 8-bit words are checked bit for bit in the next test.)"""
    changed = []
    for prompt in GREEDY_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        reply = _chat(pair, messages, bits, group)
        stats = stats_of(reply)
        assert stats.prefill == "remote", pair.decode.output()
        assert stats.kv_dtype == f"q{bits}/g{group}"
        want = pair.reference(messages, bits, group)
        assert reply.choices[0].message.content == want, prompt
        changed.append(want != pair.reference(messages, None))
    assert any(changed) or bits == 8


def _prefill_frames(pair: Pair, tokens: list[int], fmt: KVFormat | None) -> tuple[Header, list]:
    """The prefill node's own frames for `tokens`, asked for directly (a client's Bearer)."""
    rid = f"frames-q{fmt.bits}" if fmt else "frames-float"
    body = PrefillBody(fingerprint(load_index(pair.model)), rid, tokens, 0, fmt).to_json()
    req = urllib.request.Request(
        pair.prefill.url + "/v1/prefill", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        frames = decode_all(r.read())  # fed through a FrameReader as the wire would
    return frames[0], [f for f in frames if isinstance(f, LayerFrame)]


@pytest.mark.parametrize(("bits", "group"), [(8, 64), (8, 32), (4, 64)])
def test_the_wires_quantized_layers_are_mx_quantize_of_its_float_ones(
    pair: Pair, bits: int, group: int
) -> None:
    """Over real HTTP, each quantized layer the prefill node sends holds exactly what
    mx.quantize makes of the float K and V it sends for the same prompt."""
    from tandem.nodes.contract.frames import layer_parts_to_numpy

    tokens = pair.tokens([{"role": "user", "content": PROMPTS[0]}])
    fh, floats = _prefill_frames(pair, tokens, None)
    qh, quantized = _prefill_frames(pair, tokens, KVFormat(bits, group))
    assert (qh.kv_bits, qh.kv_group_size) == (bits, group) and len(floats) == len(quantized) == 4
    for f, q in zip(floats, quantized, strict=True):
        flt, got = layer_parts_to_numpy(f, fh), layer_parts_to_numpy(q, qh)
        for name in ("k", "v"):
            want = mx.quantize(mx.array(flt[name]), group_size=group, bits=bits)
            for suffix, w in zip(("", "_scales", "_biases"), want, strict=True):
                assert np.array_equal(got[name + suffix], np.array(w)), (f.layer, name + suffix)


def test_the_prefill_nodes_prefix_cache_keeps_full_precision(pair: Pair) -> None:
    """After an 8-bit request, a longer prompt with the same prefix reuses the prefill node's
    prefix cache: in float its K/V still match mlx-lm's float prefill (a cache kept in 8 bits
    would be off by ~1e-2); asked again in 8 bits from position 0, the positions that come
    from the cache (all but the last, which is computed again, alone) are quantized there
    into exactly mx.quantize of those float K/V."""
    from mlx_lm.models.cache import make_prompt_cache
    from tandem.nodes.contract.frames import layer_parts_to_numpy

    head = pair.tokens([{"role": "user", "content": "Count the waves, keeper."}])
    longer = [*head, 7, 11, 13]
    q8 = KVFormat(8, 64)
    _prefill_frames(pair, head, q8)  # the prefix cache now holds `head`
    fh, floats = _prefill_frames(pair, longer, None)
    qh, quantized = _prefill_frames(pair, longer, q8)
    ref = make_prompt_cache(pair.mlx_model)
    pair.mlx_model(mx.array([longer]), cache=ref)
    for f, q, c in zip(floats, quantized, ref, strict=True):
        flt, got = layer_parts_to_numpy(f, fh), layer_parts_to_numpy(q, qh)
        for name, want in (("k", c.keys), ("v", c.values)):
            mlx_float = np.array(want[..., : len(longer), :])
            np.testing.assert_allclose(flt[name], mlx_float, rtol=0, atol=1e-4)
            cached = slice(0, len(longer) - 1)
            want_q = mx.quantize(mx.array(flt[name][:, :, cached]), group_size=64, bits=8)
            for suffix, w in zip(("", "_scales", "_biases"), want_q, strict=True):
                assert np.array_equal(got[name + suffix][:, :, cached], np.array(w)), f.layer


def test_a_second_turn_appends_to_the_quantized_cache(pair: Pair) -> None:
    """Turn 2 reuses turn 1's quantized cache (start = k > 0) and the prefill node's frames
    append to it. (Its reply is not mlx-lm's from-scratch one, by construction: turn 1's
    generated positions were computed attending to a quantized cache, a from-scratch prefill
    computes them attending to float K/V. Checked: the turn is served remotely from a reused
    prefix, in the same format, and answers as the same request asked again does.)"""
    messages = [{"role": "user", "content": "Name three colours."}]
    first = _chat(pair, messages, 8)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And three animals?"},
    ]
    second = _chat(pair, messages, 8)
    stats = stats_of(second)
    assert stats.prefill == "remote"
    assert stats.prefill_tokens < len(pair.tokens(messages)) - 1  # a prefix was reused
    assert stats.kv_dtype == "q8/g64"
    again = _chat(pair, messages, 8)  # now from the cache stored after turn 2
    assert again.choices[0].message.content == second.choices[0].message.content


def test_bad_kv_formats_are_400(pair: Pair) -> None:
    with pytest.raises(openai.BadRequestError, match="kv_bits"):
        _chat(pair, [{"role": "user", "content": "hi"}], 3)
    # a supported group size that does not divide the model's head_dim (64) is the client's
    # error, refused before any prefill (it was a 500 from the local quantizer)
    with pytest.raises(openai.BadRequestError, match="does not divide this model's head_dim 64"):
        pair.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"tandem": {"kv_bits": 8, "kv_group_size": 128}},
        )  # fmt: skip
    body = {"proto": PROTO, "fingerprint": fingerprint(load_index(pair.model)), "start": 0,
            "tokens": [1, 2, 3], "kv_bits": 8, "kv_group_size": 48}  # fmt: skip
    req = urllib.request.Request(
        pair.prefill.url + "/v1/prefill", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["code"] == "bad_kv_format"


def test_a_node_default_group_size_that_does_not_divide_head_dim_is_refused_at_start(
    tiny_model: MakeTiny, tmp_path: Path
) -> None:
    model = tiny_model(arch="llama", layers=4, hidden=64, heads=2, kv_heads=1, head_dim=64)
    node = start_node(tmp_path, model, "decode", "--kv-bits", "8", "--kv-group-size", "128",
                      token=TOKEN, wait=False)  # fmt: skip
    assert node.proc.wait(60) == 2
    out = node.output()
    assert "--kv-group-size: kv_group_size 128 does not divide this model's head_dim 64" in out
    assert "(group sizes that do: 32, 64)" in out and "Traceback" not in out


def test_a_local_quantized_prefill_is_mlx_lms_too(tiny_model: MakeTiny, tmp_path: Path) -> None:
    """A decode node alone with --kv-bits 4 quantizes its own cache as mlx-lm does."""
    from mlx_lm import generate, load

    model = tiny_model(arch="llama", layers=4, hidden=64, heads=2, kv_heads=1, head_dim=64)
    node = start_node(tmp_path, model, "decode", "--kv-bits", "4", token=TOKEN)
    try:
        client = openai.OpenAI(base_url=node.url + "/v1", api_key=TOKEN)
        messages = [{"role": "user", "content": PROMPTS[1]}]
        reply = client.chat.completions.create(
            model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert stats_of(reply).kv_dtype == "q4/g64"
        net, tok = load(str(model))
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True))
        want = generate(net, tok, ids, max_tokens=MAX_TOKENS, kv_bits=4, kv_group_size=64,
                        quantized_kv_start=0)  # fmt: skip
        assert reply.choices[0].message.content == want
    finally:
        node.stop()


def test_the_dashboard_shows_each_replys_kv_dtype() -> None:
    from tandem.app.tui.widgets.chat import stats_line
    from tandem.nodes.contract.bodies import ReplyStats

    stats = ReplyStats.from_json({"prefill": "remote", "kv_dtype": "q4/g64"})
    assert "KV q4/g64" in stats_line(stats)
    assert "KV" not in stats_line(ReplyStats())  # a node that does not say: nothing shown


async def test_a_peer_of_the_old_protocol_is_refused_with_a_clear_reason() -> None:
    """Proto 2 carries quantized frames: a proto-1 prefill node is not trusted, and says why."""
    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer
    from tandem.nodes.cluster.peers import PeerTable

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "id": "old", "name": "old", "proto": 1,
                                  "roles": ["prefill"], "model": {"fingerprint": "f"}})  # fmt: skip

    app = web.Application()
    app.router.add_get("/health", health)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        table = PeerTable("me", "f", TOKEN, PROTO)
        url = str(server.make_url("")).rstrip("/")
        table.add(url)
        table._session = session
        peer = await table.check(url)
    assert peer is not None and not peer.trusted and peer.reason == "protocol_mismatch"
