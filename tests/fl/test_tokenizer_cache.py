"""fl.models.base.load_tokenizer parses a folder once per process and hands out copies:
a caller's changes never reach another caller, and a folder whose files changed is parsed
again."""

from fl.models.base import load_tokenizer


def test_each_call_gets_its_own_tokenizer_and_changed_folders_are_reloaded(tmp_path):
    a, b = load_tokenizer("tiny-bert"), load_tokenizer("tiny-bert")
    assert a is not b and a("private text")["input_ids"] == b("private text")["input_ids"]
    b.pad_token = b.sep_token
    assert load_tokenizer("tiny-bert").pad_token == a.pad_token != b.pad_token

    folder = tmp_path / "tok"
    a.save_pretrained(folder)
    first = load_tokenizer(str(folder))
    assert len(first) == len(a)
    grown = load_tokenizer(str(folder))
    grown.add_tokens(["fedloraword"])
    grown.save_pretrained(folder)  # the folder's files change: parsed again
    again = load_tokenizer(str(folder))
    assert len(again) == len(a) + 1 and len(load_tokenizer(str(folder))) == len(a) + 1
