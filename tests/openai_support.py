"""Node processes as the OpenAI tests use them: started together, healthy before the tests,
stopped after; an OpenAI client for each."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import openai

from tests.nodeproc import NodeProc, stop_all, wait_healthy


@contextmanager
def all_healthy(*nodes: NodeProc) -> Iterator[None]:
    """Wait until every node (started with `wait=False`, so their loads overlap) answers
    /health; stop them all on the way out, healthy or not."""
    try:
        for node in nodes:
            wait_healthy(node)
        yield
    finally:
        stop_all(nodes)


def openai_client(node: NodeProc) -> openai.OpenAI:
    """A client of `node`'s OpenAI API with the node's token and no retries (a failure shows
    as itself, not as a retry's)."""
    return openai.OpenAI(base_url=node.url + "/v1", api_key=node.token, max_retries=0)
