"""Preference pairs (`zerojax.data.preference`): text and chat records -> padded chosen / rejected
rows whose labels are the completion's tokens only (a chat prompt's own assistant turns not
learned); the reader interface the trainer uses (deterministic per seed, resumable); errors that
name the file, the line and the fix."""
import json

import numpy as np
import pytest
from data.test_finetune_data import folder, ids_of  # noqa: F401 (tests/ on sys.path; the fixture)

from zerojax.data.finetune import load_finetune_data
from zerojax.data.preference import load_preference_data
from zerojax.data.text import DataError

SEQ = 16


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _learned(ids, labels):
    return " ".join(str(i) for i in ids[labels != -100])


def test_text_pairs_learn_the_completion(folder, tmp_path):
    data = load_preference_data(_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "what is two plus two", "chosen": "four", "rejected": "no"},
        {"prompt": "hello", "chosen": "hi there", "rejected": "ok"}]), folder, SEQ, 1)
    a = data.arrays
    assert set(a) == {"chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"}
    assert a["chosen_ids"].shape == (2, SEQ) and a["chosen_ids"].dtype == np.int32
    # <s> prompt, then the completion and </s>: only the completion's tokens are targets
    np.testing.assert_array_equal(a["chosen_ids"][0, :8], ids_of("<s> what is two plus two four </s>"))
    assert _learned(a["chosen_ids"][0], a["chosen_labels"][0]) == _learned(ids_of("four </s>"), np.zeros(2))
    assert _learned(a["rejected_ids"][1], a["rejected_labels"][1]) == _learned(ids_of("ok </s>"), np.zeros(2))
    assert (a["chosen_ids"][0, 8:] == ids_of("<pad>")[0]).all() and data.pad_id == ids_of("<pad>")[0]


def test_chat_pairs_learn_only_the_reply_after_the_prompt(folder, tmp_path):
    prompt = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
              {"role": "user", "content": "what is two plus two"}]
    data = load_preference_data(_jsonl(tmp_path / "c.jsonl", [
        {"prompt": prompt, "chosen": {"role": "assistant", "content": "four"}, "rejected": "no"}]), folder, 32, 1)
    a = data.arrays
    full = "<s> <|user|> hello </s> <|assistant|> hi </s> <|user|> what is two plus two </s> <|assistant|> four </s>"
    np.testing.assert_array_equal(a["chosen_ids"][0, :len(ids_of(full))], ids_of(full))
    assert _learned(a["chosen_ids"][0], a["chosen_labels"][0]) == _learned(ids_of("four </s>"), np.zeros(2))
    assert _learned(a["rejected_ids"][0], a["rejected_labels"][0]) == _learned(ids_of("no </s>"), np.zeros(2))


def test_reader_is_deterministic_and_resumable(folder, tmp_path):
    pairs = [{"prompt": "hello", "chosen": w, "rejected": "no"} for w in ["yes", "ok", "four", "hi"] * 20]
    data = load_preference_data(_jsonl(tmp_path / "r.jsonl", pairs), folder, 8, 4)
    assert (data.n_train, data.n_val, data.steps_per_epoch) == (76, 4, 19)
    run = lambda start, n: [b["chosen_ids"] for b in data.train_batches(4, seed=3, start_step=start, num_steps=n)]  # noqa: E731
    whole, again = run(0, 12), run(0, 12)
    assert all((x == y).all() for x, y in zip(whole, again, strict=True))
    assert all((x == y).all() for x, y in zip(whole[5:], run(5, 7), strict=True))  # resumed at step 5
    assert [len(b["chosen_ids"]) for b in data.val_batches(4)] == [4]


@pytest.mark.parametrize("line,words", [
    ('{"prompt": "hello", "chosen": "yes"}', ["no 'rejected'", "chosen"]),
    ('{"prompt": "hello", "chosen": "", "rejected": "no"}', ["empty 'chosen'"]),
    ('{"prompt": "hello", "chosen": "yes", "rejected": {"role": "assistant", "content": "no"}}',
     ["'rejected' is a dict", "chat messages"]),
    ('{"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "user", "content": "yes"}], '
     '"rejected": "no"}', ["no \"assistant\" message"]),
    ('{"prompt": "what is two plus two what is two plus two", "chosen": "four", "rejected": "no"}',
     ["the first 6 (seq_len) hold none", "raise seq_len"]),
    ('{"prompt": "hello", "chosen": "yes", "rejected": "no"', ["not JSON"]),
    ('[1, 2]', ["a JSON list"]),
])
def test_errors_name_the_file_line_and_fix(folder, tmp_path, line, words):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "hello", "chosen": "yes", "rejected": "no"}, line])
    with pytest.raises(DataError) as e:
        load_preference_data(path, folder, 6, 1)
    assert f"{path}:2:" in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_preference_records_refused_as_finetuning_data(folder, tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "hello", "chosen": "yes", "rejected": "no"}])
    with pytest.raises(DataError, match=r"p.jsonl:1: a preference pair .*\(DPO or a reward model"):
        load_finetune_data(path, folder, seq_len=8)
