"""The demo's training text: zerolap's own documentation, read from the installed package.

Every module docstring of ``zerolap`` (the prose that explains buckets, rings, stages and
overlap) plus a short preface, so the demo needs no download and its model learns to write
about the library it runs on. Characters are the tokens.
"""

from __future__ import annotations

import ast
from importlib import resources

import torch

__all__ = ["CharTokenizer", "corpus_text"]

PREFACE = """zerolap trains PyTorch models across processes with ZeRO sharding.
Gradients are reduced in buckets while backward still runs, so communication hides behind
computation. Stage 1 shards the optimizer state, stage 2 the gradients as well, and every rank
keeps only what it owns. A ring all-reduce is a reduce-scatter followed by an all-gather, and
each rank sends 2K(N-1)/N elements for a tensor of K elements.
"""


def corpus_text() -> str:
    """The preface and the docstring of every module of the package, in path order."""
    root = resources.files("zerolap")
    docs = [PREFACE]
    for path in sorted(_python_files(root), key=str):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if doc:
            docs.append(doc)
    return "\n\n".join(docs)


def _python_files(folder):
    for entry in folder.iterdir():
        if entry.is_dir() and entry.name != "__pycache__":
            yield from _python_files(entry)
        elif entry.name.endswith(".py"):
            yield entry


class CharTokenizer:
    """One token per distinct character of the text it was built from."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)
