"""Run under `torchrun --nproc-per-node 2` by tests/test_rank_events.py: each rank's engine as a
node builds it (`ranked_engine`), one prompt prefilled; rank 0 saves the layer and link events
its bus (the node's) got from rank 1, and what is left open once the ranks have closed.

    rank_events_run.py OUT MODEL BUDGET
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from tandem.nodes.contract.events import Event, EventBus, LayerEvent, LinkEvent
from tandem.nodes.model import load_index
from tandem.nodes.prefill.ranks.collective import world_from_env
from tandem.nodes.serve.node import NodeConfig
from tandem.nodes.serve.prefill_side import follow_prefill, ranked_engine

PROMPT = [(7 * i + 3) % 500 for i in range(17)]
RID = "chatcmpl-ranked"


def main() -> None:
    out, model, budget = sys.argv[1:]
    config = NodeConfig(model=Path(model), roles=("prefill",), device="cpu", budget=int(budget),
                        chunk_tokens=8, ranks=world_from_env())  # fmt: skip
    index = load_index(Path(model))
    if config.ranks is not None and config.ranks[0] != 0:
        sys.exit(follow_prefill(index, config))  # closes its engine and its ranks
    node = EventBus("node-0")
    got: list[Event] = []
    node.listen(got.append)
    engine = ranked_engine(index, config, events=node)
    for _ in engine.prefill(PROMPT, request_id=RID):
        pass
    deadline = time.monotonic() + 10  # rank 1's records of the pass, on their way
    while time.monotonic() < deadline and not any(
        isinstance(e, LayerEvent) and e.rank == 1 and e.state == "evicted" and e.layer == 3
        for e in got
    ):
        time.sleep(0.01)
    engine.close()
    assert engine.collective is not None
    engine.collective.close()
    ranked = [e.to_dict() for e in got if isinstance(e, LayerEvent | LinkEvent)]
    threads = [t.name for t in threading.enumerate() if t.name == "rank events"]
    Path(out, "events.json").write_text(json.dumps({"events": ranked, "threads": threads}))


if __name__ == "__main__":
    main()
