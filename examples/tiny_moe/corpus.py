"""The example's training text: CPython's `pydoc_data.topics`, split once into committed files.

The split is committed (`corpus_train.txt`, `corpus_heldout.txt`) so that training and the
affinity figures do not change with the Python version that happens to be installed. Running this
file regenerates the split from the current interpreter's `pydoc_data` (only needed once).

Split: topics sorted by name; every 8th topic (index % 8 == 2) is held out (about 10% of the
bytes), the rest is training text. Topics are joined by a blank line, UTF-8 encoded.
"""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN_FILE = HERE / "corpus_train.txt"
HELDOUT_FILE = HERE / "corpus_heldout.txt"
HELDOUT_EVERY, HELDOUT_OFFSET = 8, 2


def split_topics(topics: dict[str, str]) -> tuple[str, str]:
    """(train text, held-out text) from a {topic name: text} mapping, deterministically."""
    train, heldout = [], []
    for index, name in enumerate(sorted(topics)):
        (heldout if index % HELDOUT_EVERY == HELDOUT_OFFSET else train).append(topics[name].strip())
    return "\n\n".join(train) + "\n", "\n\n".join(heldout) + "\n"


def read_bytes(path: Path) -> bytes:
    """A corpus file as bytes: the model's vocabulary is the 256 byte values."""
    return Path(path).read_bytes()


def main() -> None:
    from pydoc_data.topics import topics

    train, heldout = split_topics(topics)
    TRAIN_FILE.write_text(train, encoding="utf-8")
    HELDOUT_FILE.write_text(heldout, encoding="utf-8")
    print(f"{TRAIN_FILE.name}: {len(train.encode())} bytes; {HELDOUT_FILE.name}: {len(heldout.encode())} bytes")


if __name__ == "__main__":
    main()
