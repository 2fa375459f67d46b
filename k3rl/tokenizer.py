"""Tokenizers: a byte-level tokenizer with the K3 special tokens, and the real ones from disk.

Plain text never produces a special token: `encode` treats its input as untrusted text
(user messages, tool output), so the literal string "<|open|>" becomes ordinary bytes or
BPE pieces. Structural tokens only enter through `special(name)`, which the chat template
calls in its trusted segments. This is what makes prompt injection through markup
impossible (docs/model.md §9.7).

`load_tokenizer(DIR)` reads the official K3 files (`tiktoken.model` + `tokenizer_config.json`,
with the `tiktoken` package) or a Hugging Face `tokenizer.json`.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Protocol

import tiktoken
from tokenizers import Tokenizer as _HF

# The K3 special tokens and their ids in the released vocabulary (docs/model.md §9.7, §7.4).
SPECIAL_TOKEN_IDS: dict[str, int] = {
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
OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"  # what the chat template needs


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
        for name, k3_id in SPECIAL_TOKEN_IDS.items():
            offset = k3_id - K3_FIRST_SPECIAL
            self.specials[name] = 256 + offset if offset < 62 else self.vocab_size - (SPECIAL_TOKEN_IDS["[PAD]"] - k3_id) - 1
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
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json at {file}; point model.tokenizer at a directory that holds one")
        self._tok = _HF.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.specials = {name: vocab[name] for name in SPECIAL_TOKEN_IDS if name in vocab}
        missing = [n for n in (OPEN, CLOSE, SEP, EOM) if n not in self.specials]
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


class TiktokenTokenizer(_SpecialsMixin):
    """The official K3 tokenizer: `tiktoken.model` (BPE ranks) and `tokenizer_config.json` (specials).

    As the checkpoint's `tokenization_kimi.py` does: the ranks are ids 0..n-1, the special tokens
    take ids n.. (named by the config's `added_tokens_decoder`, the unnamed ones
    `<|reserved_token_ID|>`; at least 256 of them), the pre-tokenizer is the Kimi pattern below,
    and text is cut into slices of at most 400,000 characters and runs of at most 25,000
    whitespace or non-whitespace characters before encoding. Text is encoded as ordinary text:
    a special token's name in it gives ordinary tokens.
    """

    PATTERN = "|".join([
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ])
    NUM_RESERVED = 256
    MAX_SLICE_CHARS = 400_000
    MAX_RUN_CHARS = 25_000

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        model, config = folder / "tiktoken.model", folder / "tokenizer_config.json"
        if not config.exists():
            raise FileNotFoundError(f"no tokenizer_config.json beside {model}: it names the special tokens "
                                    "(added_tokens_decoder); copy it from the checkpoint")
        ranks = _read_bpe_ranks(model)
        first = len(ranks)
        try:
            added = {int(i): t["content"] for i, t in json.loads(config.read_text())["added_tokens_decoder"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{config}: expected an 'added_tokens_decoder' mapping id -> {{'content': name}} "
                             f"({type(e).__name__}: {e})") from None
        clash = sorted(i for i in added if i < first)
        if clash:
            raise ValueError(f"{config}: special ids {clash[:5]} fall inside the {first} BPE ranks of {model}")
        last = max([first + self.NUM_RESERVED - 1, *added])
        self.specials = {added.get(i, f"<|reserved_token_{i}|>"): i for i in range(first, last + 1)}
        missing = [n for n in (OPEN, CLOSE, SEP, EOM) if n not in self.specials]
        if missing:
            raise ValueError(f"{config} lacks the K3 structural tokens {missing}")
        self._names_by_id = {v: k for k, v in self.specials.items()}
        self._enc = tiktoken.Encoding(name=folder.name or "k3", pat_str=self.PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self.specials)
        self.vocab_size = last + 1

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for start in range(0, len(text), self.MAX_SLICE_CHARS):
            for chunk in _runs_at_most(text[start:start + self.MAX_SLICE_CHARS], self.MAX_RUN_CHARS):
                ids.extend(self._enc.encode_ordinary(chunk))
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The raw bytes of non-special ids (used to decode text runs exactly)."""
        return self._enc.decode_bytes([i for i in ids if i not in self._names_by_id])



def _read_bpe_ranks(file: Path) -> dict[bytes, int]:
    """A tiktoken BPE file: one `base64(token) rank` per line, ranks 0..n-1."""
    if not file.exists():
        raise FileNotFoundError(f"no tiktoken.model at {file}")
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(file.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"{file}, line {n}: expected 'base64-token rank', got {line[:60]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{file}: the ranks are not exactly 0..{len(ranks) - 1}")
    return ranks


def _runs_at_most(text: str, limit: int) -> list[str]:
    """`text` cut so that no slice holds more than `limit` consecutive whitespace or non-whitespace
    characters (the cut the official tokenizer makes to keep tiktoken within its limits)."""
    slices, start, run, space = [], 0, 0, text[:1].isspace()
    for i, ch in enumerate(text):
        if ch.isspace() != space:
            space, run = ch.isspace(), 1
            continue
        run += 1
        if run > limit:
            slices.append(text[start:i])
            start, run = i, 1
    slices.append(text[start:])
    return slices


def load_tokenizer(path: str | Path | None = None) -> ByteTokenizer | HFTokenizer | TiktokenTokenizer:
    """The byte tokenizer by default; else the tokenizer in a directory: the official K3 files
    (tiktoken.model + tokenizer_config.json) or a Hugging Face tokenizer.json."""
    if path in (None, "", "byte"):
        return ByteTokenizer()
    path = Path(path)
    if path.name == "tiktoken.model" or (path.is_dir() and (path / "tiktoken.model").exists()):
        return TiktokenTokenizer(path)
    if path.name == "tokenizer.json" or (path.is_dir() and (path / "tokenizer.json").exists()):
        return HFTokenizer(path)
    raise FileNotFoundError(f"no tokenizer at {path}: model.tokenizer must be 'byte' or a directory holding "
                            "tiktoken.model + tokenizer_config.json (the K3 checkpoint's) or tokenizer.json")
