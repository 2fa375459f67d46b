"""Tokenizers: a byte-level tokenizer with the K3 special tokens, and a real one from disk.

Plain text never produces a special token: `encode` treats its input as untrusted text
(user messages, tool output), so the literal string "<|open|>" becomes ordinary bytes or
BPE pieces. Structural tokens only enter through `special(name)`, which the chat template
calls in its trusted segments. This is what makes prompt injection through markup
impossible (docs/model.md §9.7).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

# The K3 special tokens and their ids in the released vocabulary (docs/model.md §9.7, §7.4).
K3_SPECIAL_IDS: dict[str, int] = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|end_of_msg|>": 163586,
    "<|open|>": 163587,
    "<|close|>": 163588,
    "<|sep|>": 163589,
    "[start_header_id]": 163590,
    "[end_header_id]": 163591,
    "[EOT]": 163593,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "[UNK]": 163838,
    "[PAD]": 163839,
}
K3_FIRST_SPECIAL = 163584


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def special(self, name: str) -> int: ...
    def is_special(self, token_id: int) -> bool: ...
    def special_name(self, token_id: int) -> str | None: ...


class _SpecialsMixin:
    specials: dict[str, int]
    _names_by_id: dict[int, str]

    def special(self, name: str) -> int:
        try:
            return self.specials[name]
        except KeyError:
            raise KeyError(f"unknown special token {name!r}; known: {sorted(self.specials)}") from None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._names_by_id

    def special_name(self, token_id: int) -> str | None:
        return self._names_by_id.get(token_id)

    @property
    def eos_id(self) -> int:
        return self.special("<|end_of_msg|>")

    @property
    def pad_id(self) -> int:
        return self.special("[PAD]")


class ByteTokenizer(_SpecialsMixin):
    """Bytes 0..255 are ids 0..255; the K3 specials follow from 256 keeping their order.

    id(special) = 256 + (k3_id - 163584) for the block starting at [BOS]; [UNK] and [PAD]
    take the last two ids. vocab_size is 320 (a multiple of 64, good for kernels).
    """

    vocab_size = 320

    def __init__(self) -> None:
        self.specials = {}
        for name, k3_id in K3_SPECIAL_IDS.items():
            offset = k3_id - K3_FIRST_SPECIAL
            self.specials[name] = 256 + offset if offset < 62 else self.vocab_size - (K3_SPECIAL_IDS["[PAD]"] - k3_id) - 1
        self._names_by_id = {v: k for k, v in self.specials.items()}
        assert len(self._names_by_id) == len(self.specials) and max(self._names_by_id) < self.vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        parts: list[str] = []
        for i in ids:
            if i < 256:
                out.append(i)
            else:
                if out:
                    parts.append(out.decode("utf-8", errors="replace"))
                    out.clear()
                parts.append(self._names_by_id.get(i, "[UNK]"))
        if out:
            parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The raw bytes of non-special ids (used to decode text runs exactly)."""
        return bytes(i for i in ids if i < 256)


class HFTokenizer(_SpecialsMixin):
    """A real tokenizer read from a local directory holding `tokenizer.json`.

    Special tokens are looked up by name in the file's added tokens; text is encoded with
    special-token matching defeated, so untrusted text stays plain BPE.
    """

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as e:  # pragma: no cover - tokenizers is a dependency
            raise ImportError("loading a tokenizer.json needs the 'tokenizers' package: pip install tokenizers") from e
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json at {file}; point tokenizer.path at a directory that holds one")
        self._tok = _HF.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.specials = {name: vocab[name] for name in K3_SPECIAL_IDS if name in vocab}
        missing = [n for n in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>") if n not in self.specials]
        if missing:
            raise ValueError(f"tokenizer at {file} lacks the K3 structural tokens {missing}")
        self._names_by_id = {v: k for k, v in self.specials.items()}
        added = json.loads(file.read_text()).get("added_tokens", [])
        self._added_strings = sorted({t["content"] for t in added}, key=len, reverse=True)

    def encode(self, text: str) -> list[int]:
        # Split around any added-token string and encode its halves separately, so the
        # tokenizer's added-token matcher never sees the whole string.
        pieces = [text]
        for s in self._added_strings:
            if any(s in p for p in pieces):
                split: list[str] = []
                for p in pieces:
                    chunks = p.split(s)
                    for j, c in enumerate(chunks):
                        split.append(c)
                        if j < len(chunks) - 1:
                            split.extend([s[: len(s) // 2], s[len(s) // 2 :]])
                pieces = split
        ids: list[int] = []
        for p in pieces:
            if p:
                ids.extend(self._tok.encode(p, add_special_tokens=False).ids)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(path: str | Path | None = None) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer by default; a real one when a directory with tokenizer.json is given."""
    if path in (None, "", "byte"):
        return ByteTokenizer()
    return HFTokenizer(path)
