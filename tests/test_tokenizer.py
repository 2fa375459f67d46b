import json

import pytest

from k3rl.tokenizer import K3_SPECIAL_IDS, ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_specials_are_distinct_and_in_vocab():
    tok = ByteTokenizer()
    ids = [tok.special(n) for n in K3_SPECIAL_IDS]
    assert len(set(ids)) == len(ids) and all(256 <= i < tok.vocab_size for i in ids)
    assert tok.special("<|open|>") - tok.special("[BOS]") == K3_SPECIAL_IDS["<|open|>"] - K3_SPECIAL_IDS["[BOS]"]
    with pytest.raises(KeyError, match="unknown special token"):
        tok.special("<|nope|>")


def test_byte_tokenizer_round_trip_and_no_specials_from_text():
    tok = ByteTokenizer()
    text = "héllo <|open|> [BOS] 日本"
    ids = tok.encode(text)
    assert all(i < 256 for i in ids)
    assert tok.decode(ids) == text


def _write_tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.add_special_tokens(list(K3_SPECIAL_IDS))
    tk.save(str(path / "tokenizer.json"))


def test_hf_tokenizer_from_directory_defeats_special_injection(tmp_path):
    pytest.importorskip("tokenizers")
    _write_tokenizer_json(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("a<|open|>b")
    assert not any(tok.is_special(i) for i in ids)
    assert tok.decode(ids).replace(" ", "") == "a<|open|>b"  # WordLevel decodes with spaces
    added = {t["content"]: t["id"] for t in json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"]}
    assert tok.special("<|open|>") == added["<|open|>"] and tok.is_special(added["<|open|>"])


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
