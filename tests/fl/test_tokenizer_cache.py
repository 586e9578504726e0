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


def test_the_size_is_read_without_a_copy(tmp_path, monkeypatch):
    import copy

    from transformers import PreTrainedTokenizerBase

    from fl.models.base import tokenizer_size

    tok = load_tokenizer("tiny-bert")
    copies = []  # tokenizers copied (parsing a folder deep-copies its own small dicts)
    real = copy.deepcopy

    def deepcopy(x, *a):
        if isinstance(x, PreTrainedTokenizerBase):
            copies.append(x)
        return real(x, *a)

    monkeypatch.setattr(copy, "deepcopy", deepcopy)
    assert tokenizer_size("tiny-bert") == len(tok)
    assert tokenizer_size("tiny-bert", added=False) == tok.vocab_size
    assert copies == []
    # a folder whose tokenizer has an added token: len counts it, vocab_size does not
    tok.add_tokens(["fedloraword"])
    tok.save_pretrained(tmp_path / "tok")
    assert tokenizer_size(str(tmp_path / "tok")) == tok.vocab_size + 1
    assert tokenizer_size(str(tmp_path / "tok"), added=False) == tok.vocab_size
    assert copies == []
    load_tokenizer("tiny-bert")  # the instrument sees a copy where one is made
    assert len(copies) == 1


def test_an_encoding_tokenizer_is_one_copy_per_thread_and_encodes_as_a_fresh_one():
    import threading

    from fl.models.base import encoding_tokenizer

    texts = ["a private sentence about the weather", "short", "x " * 40]
    mine = encoding_tokenizer("tiny-bert")
    assert encoding_tokenizer("tiny-bert") is mine  # no copy on the second call
    assert mine is not load_tokenizer("tiny-bert")
    # calls with other truncation/padding arguments between two equal calls change nothing:
    # each call sets the backend's truncation and padding from its own arguments
    for kw in (
        dict(padding="max_length", truncation=True, max_length=24),
        dict(padding="longest", truncation=True, max_length=8),
        dict(add_special_tokens=False),
        dict(padding="max_length", truncation=True, max_length=24),
    ):
        assert (
            mine(texts, **kw)["input_ids"] == load_tokenizer("tiny-bert")(texts, **kw)["input_ids"]
        )
    other = []
    t = threading.Thread(target=lambda: other.append(encoding_tokenizer("tiny-bert")))
    t.start()
    t.join()
    assert other[0] is not mine  # another thread encodes with its own copy
