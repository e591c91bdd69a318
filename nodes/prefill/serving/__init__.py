"""The prefill node's HTTP side: `/v1/prefill` (`server.py`), its queue of passes, and the
prefix cache of past prompts' K/V."""
