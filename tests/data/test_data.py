"""Text -> token blocks -> batches: packing, order, process shares, tokenizers, default corpus."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zerojax.data import text as data
from zerojax.data.corpus.build import BUILT_WITH
from zerojax.data.text import Batches, ByteTokenizer, default_corpus, load_text_data, pack, tokenize


def test_pack_concatenates_back_to_stream():
    tokens = np.arange(1000, dtype=np.int32) % 251
    blocks = pack(tokens, 64)
    assert blocks.shape == (15, 64) and blocks.dtype == np.int32
    np.testing.assert_array_equal(blocks.reshape(-1), tokens[: 15 * 64])


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓ — zerojax\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_files_folder_and_split(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("first document. " * 20)
    with open(tmp_path / "b" / "c.jsonl", "w") as f:
        for i in range(5):
            f.write(json.dumps({"text": f"record {i} " * 10, "id": i}) + "\n")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    docs = data.read_texts(tmp_path)
    assert docs[0].startswith("first document.") and docs[1:] == [f"record {i} " * 10 for i in range(5)]
    d = load_text_data(tmp_path, seq_len=16, val_fraction=0.1)
    stream = ByteTokenizer().encode("\n\n".join(docs))
    assert d.train.shape[1] == d.val.shape[1] == 16 and len(d.val) >= 1
    np.testing.assert_array_equal(np.concatenate([d.train, d.val]).reshape(-1),
                                  stream[: (len(d.train) + len(d.val)) * 16])


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_text_data(missing, seq_len=8)
    with pytest.raises(FileNotFoundError, match="tok.json"):
        data.load_tokenizer(tmp_path / "tok.json")


def _blocks(n=40, seq=4):
    return np.arange(n * seq, dtype=np.int32).reshape(n, seq)


def test_order_deterministic_per_seed():
    blocks = _blocks()
    take = lambda seed: np.stack([b for b in Batches(blocks, 8, seed=seed, process_index=0,  # noqa: E731
                                                     process_count=1, num_steps=10)])
    np.testing.assert_array_equal(take(0), take(0))
    assert not np.array_equal(take(0), take(1))
    epoch0, epoch1 = take(0)[:5], take(0)[5:]
    # each epoch (5 steps of 8) is a permutation of all 40 blocks, and epochs differ in order
    for ep in (epoch0, epoch1):
        np.testing.assert_array_equal(np.sort(ep[:, :, 0].reshape(-1)), blocks[:, 0])
    assert not np.array_equal(epoch0, epoch1)
    # random access equals iteration, so a resumed run continues exactly
    b = Batches(blocks, 8, seed=0, process_index=0, process_count=1, start_step=7)
    np.testing.assert_array_equal(next(iter(b)), take(0)[7])


def test_process_shares_disjoint_and_cover():
    blocks = _blocks(48)
    count, batch = 4, 12
    shares = [Batches(blocks, batch, seed=3, process_index=p, process_count=count) for p in range(count)]
    assert all(s.local_batch_size == 3 for s in shares)
    seen = []
    for step in range(shares[0].steps_per_epoch):
        parts = [s[step] for s in shares]
        assert all(part.shape == (3, 4) and part.dtype == np.int32 for part in parts)
        ids = [set(part[:, 0].tolist()) for part in parts]
        assert all(not (ids[i] & ids[j]) for i in range(count) for j in range(i + 1, count))
        np.testing.assert_array_equal(np.concatenate(parts), blocks[shares[0].global_rows(step)])
        seen += [x for s in ids for x in s]
    assert sorted(seen) == blocks[:, 0].tolist()  # one epoch over all processes = every block once
    with pytest.raises(ValueError, match="divisible"):
        Batches(blocks, 10, process_index=0, process_count=4)


def test_default_process_from_jax():
    b = Batches(_blocks(), 8)
    assert (b.process_index, b.process_count) == (0, 1)


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat", "the dog sat"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    (tmp_path / "docs.jsonl").write_text(
        "\n".join(json.dumps({"text": t}) for t in ["the cat sat", "the dog sat on the mat"]))

    loaded = data.load_tokenizer(tmp_path)  # a folder holding tokenizer.json works too
    assert loaded.vocab_size == tok.get_vocab_size() and loaded.eos_id == tok.token_to_id("<|endoftext|>")
    assert loaded.decode(loaded.encode("the cat sat on the mat")) == "the cat sat on the mat"
    stream = tokenize(["the cat sat", "the dog sat on the mat"], loaded)
    expected = [tok.token_to_id(w) for w in "the cat sat <|endoftext|> the dog sat on the mat".split()]
    assert stream.tolist() == expected
    d = load_text_data(tmp_path / "docs.jsonl", seq_len=3, tokenizer=path, val_fraction=0.0)
    np.testing.assert_array_equal(d.train.reshape(-1), np.asarray(expected[:9]))


def test_default_corpus():
    text = default_corpus()
    assert len(text) > 100_000 and len(text) < 5_000_000
    assert "Module json" in text and " at 0x" not in text  # no object reprs with addresses
    d = load_text_data(None, seq_len=128, val_fraction=0.01)
    assert d.vocab_size == 256 and len(d.train) > 500 and len(d.val) >= 1
    assert d.train.max() < 256


def test_default_corpus_ignores_what_the_process_imported(monkeypatch):
    """The corpus is a snapshot: a documented method added to a corpus module's class (what
    transformers does to logging.Logger) does not reach it, rebuilt from scratch."""
    import logging

    before = default_corpus()

    def warning_once(self, msg):
        """An added method whose docstring a live build would have picked up."""

    monkeypatch.setattr(logging.Logger, "warning_once", warning_once, raising=False)
    default_corpus.cache_clear()
    assert default_corpus() == before
    assert "warning_once" not in before


BUILD = Path(data.__file__).parent / "corpus" / "build.py"


@pytest.mark.skipif(sys.version_info[:3] != BUILT_WITH, reason=f"docstrings differ between Python "
                    f"versions; the snapshot was written by Python {BUILT_WITH}")
def test_default_corpus_is_what_build_writes(tmp_path):
    """The shipped snapshot is what corpus/build.py writes in a clean interpreter (-I -S: no site
    packages, no user path) from the Python version that wrote it: byte for byte, file included."""
    out = tmp_path / "corpus.txt.gz"
    subprocess.run([sys.executable, "-I", "-S", str(BUILD), str(out)], check=True, capture_output=True)
    assert out.read_bytes() == (BUILD.parent / "stdlib_docstrings.txt.gz").read_bytes()
    assert gzip.decompress(out.read_bytes()).decode("utf-8") == default_corpus()


def _bad_files(tmp):
    (tmp / "empty.txt").write_text("")
    (tmp / "blank.jsonl").write_text("\n\n")
    (tmp / "model.bin.txt").write_bytes(b"PK\x03\x04" + bytes(range(256)))
    (tmp / "latin1.txt").write_bytes("ok line\ncaf\xe9\n".encode("latin-1"))
    (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "no closing quote}\n')
    (tmp / "notext.jsonl").write_text('{"text": "fine"}\n{"body": "x"}\n')
    (tmp / "list.jsonl").write_text('["text"]\n')
    # places by construction: the NUL follows the 4 bytes "PK\x03\x04"; "ok line\n" + "caf" is
    # 11 bytes before the Latin-1 \xe9; the bad JSON line is line 2, its string opens at column 10
    return [("empty.txt", "empty.txt: no text"),
            ("blank.jsonl", "blank.jsonl: no records"),
            ("model.bin.txt", "model.bin.txt: byte offset 4: a NUL byte"),
            ("latin1.txt", "latin1.txt: byte offset 11 (line 2): not UTF-8 text (invalid continuation byte)"),
            ("bad.jsonl", "bad.jsonl:2: column 10: not JSON (Unterminated string"),
            ("notext.jsonl", "notext.jsonl:2: no string \"text\" field (keys ['body'])"),
            ("list.jsonl", "list.jsonl:1: no string \"text\" field (a JSON list)")]


def test_unusable_files_name_file_place_and_fix(tmp_path):
    for name, message in _bad_files(tmp_path):
        with pytest.raises(data.DataError) as e:
            load_text_data(tmp_path / name, seq_len=8)
        assert message in str(e.value), (name, str(e.value))
    # a folder skips its empty files, and names itself when all are empty
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("")
    with pytest.raises(data.DataError, match="docs: its 1 .txt/.jsonl file\\(s\\) hold no text"):
        data.read_texts(folder)
    (folder / "b.txt").write_text("some text")
    assert data.read_texts(folder) == ["some text"]


def test_too_short_is_found_while_reading(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x" * 100)  # 100 byte tokens -> 3 blocks of 32; 1 held out for validation
    with pytest.raises(data.DataError, match="short.txt: too short: 100 tokens make 3 blocks of 32 "
                                             "\\(2 for training after 1 held out for validation\\), "
                                             "fewer than one batch of 8 rows"):
        load_text_data(path, seq_len=32, min_train_rows=8)
    assert len(load_text_data(path, seq_len=32, min_train_rows=2).train) == 2
