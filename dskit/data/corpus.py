"""The embedded corpus: what a run trains on when it names no data."""

from __future__ import annotations


def embedded_corpus() -> list[str]:
    """Real English text that ships with every CPython: the interpreter's own reference topics
    (pydoc_data, ~460 KB). Enough for a tiny model to visibly learn, with nothing to download."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]
