"""Drop a model's files from the page cache, so that a benchmark's next read is the disk's."""

from __future__ import annotations

import os

from tandem.nodes.model.index import ModelIndex


def evict_page_cache(index: ModelIndex) -> None:
    """posix_fadvise(DONTNEED) on every shard: no root needed, unlike drop_caches."""
    for f in index.files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
