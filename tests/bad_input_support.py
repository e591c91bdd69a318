"""What the bad-input tests (issue 18) share: raw HTTP replies and the one error body they
must carry, mlx-lm as the oracle, and `tests.bad_prefill` as a misbehaving prefill peer."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.nodes.contract.events import Event

from tests.bad_prefill import MODES
from tests.nodeproc import ROOT, NodeProc, free_port, start_node, wait_healthy, wait_trusted
from tests.records import event_of

TOKEN = "bad-input-token-0123456789"
MAX_TOKENS = 12


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip()

    def json(self) -> Any:
        return json.loads(self.body)

    def __str__(self) -> str:
        return f"{self.status} {self.content_type} {self.body[:200]!r}"


def post(
    url: str, body: bytes | str | dict[str, Any], token: str | None = TOKEN, timeout: float = 30
) -> Reply:
    """POST `body` (a dict goes as JSON, text as its UTF-8 bytes) and read the whole reply."""
    if isinstance(body, dict):
        body = json.dumps(body)
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


def status_only(url: str, body: dict[str, Any], timeout: float = 30) -> Reply:
    """POST and read just the status and headers (a 200 KV stream is not read)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, b"")
    except urllib.error.HTTPError as e:
        return Reply(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


def error_problem(reply: Reply, statuses: tuple[int, ...] = (400,)) -> str | None:
    """What is wrong with `reply` as the answer to a bad request (None: nothing)."""
    if reply.status not in statuses:
        return f"want {statuses}, got {reply}"
    if reply.content_type != "application/json":
        return f"error body is not JSON: {reply}"
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"no error object: {reply}"
    if not isinstance(error, dict) or not {"message", "type", "code"} <= error.keys():
        return f"error lacks message/type/code: {reply}"
    if not isinstance(error["message"], str):
        return f"error message is not a string: {reply}"
    return None


def assert_error(reply: Reply, statuses: tuple[int, ...] = (400,)) -> None:
    problem = error_problem(reply, statuses)
    assert problem is None, problem


def events_since(
    node: NodeProc, since: float, idle_s: float = 1.0, token: str = TOKEN
) -> list[Event]:
    """The node's event records newer than `since`: its ring replayed, then whatever arrives
    until nothing has for `idle_s`."""
    req = urllib.request.Request(f"{node.url}/v1/events?since={since}")
    req.add_header("Authorization", f"Bearer {token}")
    records: list[Event] = []
    try:
        with urllib.request.urlopen(req, timeout=idle_s) as r:
            for line in r:
                if (event := event_of(line)) is not None:
                    records.append(event)
    except TimeoutError:
        pass
    return records


class Oracle:
    """mlx-lm greedy generation from scratch: what every answer must equal."""

    def __init__(self, model: Path) -> None:
        from mlx_lm import load

        self.model_dir = model
        self.model, self.tokenizer = load(str(model))
        self.config = json.loads((model / "config.json").read_text())

    def chat_tokens(self, prompt: str) -> list[int]:
        messages = [{"role": "user", "content": prompt}]
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def reference(self, prompt: str, max_tokens: int = MAX_TOKENS, **kv: int) -> str:
        """`kv`: mlx-lm's `kv_bits` and `kv_group_size` (its cache quantized after the prompt)."""
        from mlx_lm import generate

        tokens = self.chat_tokens(prompt)
        quantized = {"quantized_kv_start": 0, **kv} if kv else {}
        return generate(self.model, self.tokenizer, tokens, max_tokens=max_tokens, **quantized)


def chat_body(prompt: str, max_tokens: int = MAX_TOKENS, **kw: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}


def tiny_llama(tiny_model: Callable[..., Path]) -> Path:
    """The bad-input tests' model, from the `tiny_model` fixture (tests/conftest.py)."""
    return tiny_model(arch="llama", layers=4, shards=2, rope_scaling="llama3")


@dataclass
class BadPeer:
    """`tests.bad_prefill` in its own process, and a decode node that always prefills on it."""

    fake: NodeProc
    decode: NodeProc

    def set_mode(self, mode: str) -> None:
        assert mode in MODES
        reply = post(self.fake.url + "/control", {"mode": mode}, token=None, timeout=10)
        assert reply.status == 200, reply

    def prefills(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.fake.url + "/control", timeout=10) as r:
            return json.loads(r.read())["prefills"]

    def thaw(self) -> None:
        """Undo a freeze and wait until the decode node trusts the peer again."""
        self.fake.proc.send_signal(signal.SIGCONT)
        self.set_mode("good")
        wait_trusted(self.decode, timeout=30)


@contextlib.contextmanager
def bad_peer(model: Path, tmp: Path) -> Iterator[BadPeer]:
    port = free_port()
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    log = tmp / "bad-prefill.log"
    cmd = [sys.executable, "-m", "tests.bad_prefill", "--model", str(model)]
    cmd += ["--token-file", str(token_file), "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    fake = NodeProc(proc, port, log)
    try:
        wait_healthy(fake)
        decode = start_node(
            tmp, model, "decode", "--peer", fake.url, "--remote-prefill", "always", token=TOKEN
        )
        try:
            wait_trusted(decode)
            yield BadPeer(fake, decode)
        finally:
            decode.stop()
    finally:
        proc.send_signal(signal.SIGCONT)  # a frozen process would not see SIGTERM
        fake.stop()
