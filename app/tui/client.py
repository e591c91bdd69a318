"""A node as the dashboard sees it over HTTP: probe, event stream, streamed chat.

No Textual here: `tandem demo --headless` uses the same client. Every failure a node can
cause becomes one `NodeError` whose `reason` matches `/v1/cluster`'s reasons, so callers
show it instead of a traceback. The bearer token goes only to a node that first proved,
through a hello (`trust/hello.py`), that it holds the same token; an `https://` node is then
reached only over a connection whose certificate is the one that hello covered (pinned).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from tandem.nodes.contract.bodies import ReplyStats
from tandem.nodes.contract.cluster import Cluster, Health
from tandem.nodes.contract.events import Event, event_from_json
from tandem.nodes.contract.http import PROTO, SSE_END, ContractError, Reason, sse_record
from tandem.nodes.trust.auth import auth_headers
from tandem.nodes.trust.hello import HelloError, prove
from tandem.nodes.trust.tls import aiohttp_pin

PROBE_TIMEOUT = aiohttp.ClientTimeout(total=3.0)
STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=3.0, sock_read=None)


class NodeError(Exception):
    """A node that cannot be used right now, and why."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Probe:
    """One look at a node: its `/health`, and its `/v1/cluster` once it proved the token."""

    url: str
    health: Health | None = None  # None until the node answered a `/health` that parses
    cluster: Cluster | None = None
    reason: Reason | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class Delta:
    """A piece of the reply's text."""

    text: str


ChatPart = Delta | ReplyStats
Parsed = TypeVar("Parsed", Health, Cluster, ReplyStats)


def normalize(url: str) -> str:
    """`host:port` or a URL → `http://host:port` without a trailing slash."""
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


class NodeClient:
    """Calls to one node through a shared session."""

    def __init__(self, session: aiohttp.ClientSession, url: str, token: str | None) -> None:
        self.session = session
        self.url = normalize(url)
        self.token = token
        self.caller = "tui-" + secrets.token_hex(4)
        self.cert_fingerprint: str | None = None  # pinned by the last hello (https:// only)
        self.proven = False  # the last hello verified: the token may go to this node

    async def probe(self) -> Probe:
        """Health, then the token proof, then the node's view of the cluster."""
        health: Health | None = None
        try:
            health = _parsed(Health, await self._get_json("/health", auth=False))
            if health.proto != PROTO:
                raise NodeError("protocol_mismatch", f"speaks proto {health.proto}")
            await self._hello(health.id)
            cluster = _parsed(Cluster, await self._get_json("/v1/cluster", auth=True))
        except NodeError as e:
            return Probe(self.url, health, None, e.reason, str(e))
        return Probe(self.url, health, cluster)

    async def _hello(self, node_id: str) -> None:
        try:
            proven = await prove(self.session, self.url, self.token, self.caller)
        except HelloError as e:
            self.cert_fingerprint, self.proven = None, False
            if e.reason == "unauthorized":
                raise NodeError("unauthorized", f"the node does not hold our token: {e}") from None
            raise NodeError(e.reason, str(e)) from None
        if proven.id != node_id:
            self.cert_fingerprint, self.proven = None, False
            raise NodeError("unauthorized", f"the hello came from {proven.id}, not {node_id}")
        self.cert_fingerprint = proven.cert_fingerprint or None
        if self.cert_fingerprint is None and self.url.startswith("https://"):
            self.proven = False
            raise NodeError("bad_reply", "the hello over TLS covered no certificate to pin")
        self.proven = True

    async def _ssl(self, auth: bool, fresh: bool = False) -> aiohttp.Fingerprint | bool:
        """`ssl=` for a request: for one that carries the token, the node proves it first
        (unless the last hello did; always when `fresh` on plain HTTP, where nothing pins the
        node between hellos), and an https:// node is reached only with the certificate that
        hello covered (pinned); public routes are not checked (the hello checks itself)."""
        https = self.url.startswith("https://")
        if not auth:
            return not https
        if not self.proven or (fresh and not https):
            health = _parsed(Health, await self._get_json("/health", auth=False))
            await self._hello(health.id)
        if not https:
            return True
        assert self.cert_fingerprint is not None
        return aiohttp_pin(self.cert_fingerprint)

    async def _get_json(self, path: str, auth: bool) -> dict[str, Any]:
        return await self._request("GET", path, auth=auth)

    async def _request(self, method: str, path: str, auth: bool, **kw: Any) -> dict[str, Any]:
        headers = auth_headers(self.token) if auth else {}
        ssl = await self._ssl(auth)
        try:
            async with self.session.request(
                method, self.url + path, headers=headers, timeout=PROBE_TIMEOUT, ssl=ssl, **kw
            ) as r:
                if r.status == 401:
                    self.proven = False
                    raise NodeError("unauthorized", "the node refuses our token")
                if r.status != 200:
                    raise NodeError("bad_reply", f"{path} answered HTTP {r.status}")
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self.proven = False  # whoever answers there next proves itself first
            raise NodeError("unreachable", _why(e)) from None
        except ValueError:
            raise NodeError("bad_reply", f"{path} did not answer JSON") from None
        if not isinstance(body, dict):
            raise NodeError("bad_reply", f"{path} did not answer a JSON object")
        return body

    async def events(
        self, since: float | None = None, on_open: Callable[[], None] | None = None
    ) -> AsyncIterator[Event]:
        """The node's event records (`/v1/events`), live, until the connection ends; one
        that is not an event known here is skipped. `on_open` is called once the node
        accepted the subscription."""
        query = f"?since={since!r}" if since is not None else ""
        ssl = await self._ssl(auth=True, fresh=True)
        try:
            async with self.session.get(
                f"{self.url}/v1/events{query}",
                headers=auth_headers(self.token),
                timeout=STREAM_TIMEOUT,
                ssl=ssl,
            ) as r:
                if r.status == 401:
                    raise NodeError("unauthorized", "the node refuses our token")
                if r.status != 200:
                    raise NodeError("bad_reply", f"/v1/events answered HTTP {r.status}")
                if on_open is not None:
                    on_open()
                async for record in _sse_records(r.content):
                    event = event_from_json(record)
                    if event is not None:
                        yield event
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise NodeError("unreachable", _why(e)) from None

    async def chat(
        self,
        messages: list[dict[str, str]],
        max_tokens: int = 256,
        temperature: float | None = None,
    ) -> AsyncIterator[ChatPart]:
        """Stream a chat completion: `Delta`s, then the reply's `ReplyStats`; `temperature`
        None leaves the node's default.

        Closing the generator (or cancelling its task) closes the connection, which cancels
        the decode and the remote prefill on the nodes.
        """
        body: dict[str, Any] = {"messages": messages, "stream": True, "max_tokens": max_tokens}
        if temperature is not None:
            body["temperature"] = temperature
        ssl = await self._ssl(auth=True, fresh=True)
        try:
            async with self.session.post(
                f"{self.url}/v1/chat/completions",
                json=body,
                headers=auth_headers(self.token),
                timeout=STREAM_TIMEOUT,
                ssl=ssl,
            ) as r:
                if r.status != 200:
                    raise NodeError(*await _api_error(r))
                async for chunk in _sse_records(r.content):
                    if not isinstance(chunk, dict):
                        continue
                    if isinstance(chunk.get("error"), dict):  # the generation failed midway
                        raise NodeError("bad_reply", str(chunk["error"].get("message", "")))
                    for choice in chunk.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            yield Delta(text)
                    if chunk.get("tandem") is not None:
                        yield _parsed(ReplyStats, chunk["tandem"])
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise NodeError("unreachable", _why(e)) from None


def _parsed(record: type[Parsed], body: Any) -> Parsed:
    """`record.from_json(body)`; a node's body that is not the record is a bad reply."""
    try:
        return record.from_json(body)
    except ContractError as e:
        raise NodeError("bad_reply", str(e)) from None


async def _sse_records(content: aiohttp.StreamReader) -> AsyncIterator[Any]:
    """The JSON of each `data:` line; stops at `data: [DONE]`."""
    async for raw in content:
        record = sse_record(raw)
        if record is SSE_END:
            return
        if record is not None:
            yield record


async def _api_error(r: aiohttp.ClientResponse) -> tuple[Reason, str]:
    if r.status == 401:
        return "unauthorized", "the node refuses our token"
    try:
        message = (await r.json(content_type=None))["error"]["message"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        message = r.reason or ""
    return "bad_reply", f"HTTP {r.status}: {message}"


def _why(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__
