import numpy as np
import pytest

from fl.data.datasets import label_skew, load_dataset, load_local, partition, split_dataset
from fl.errors import UsageError


def test_tweets_and_bbc_are_real_offline_corpora():
    tw = load_dataset("tweets")
    assert tw.num_classes == 2 and len(tw) > 20000
    assert len(set(tw.ids)) == len(tw)
    tw3 = load_dataset("tweets3")
    assert tw3.num_classes == 3 and len(tw3) > len(tw)
    bbc = load_dataset("bbc")
    assert bbc.num_classes == 5 and 2000 < len(bbc) <= 2225
    assert sorted(bbc.label_names) == ["business", "entertainment", "politics", "sports", "tech"]


def test_split_is_deterministic_and_disjoint():
    a = split_dataset(1000, 300, 200, 100, seed=3)
    b = split_dataset(1000, 300, 200, 100, seed=3)
    c = split_dataset(1000, 300, 200, 100, seed=4)
    assert all(
        np.array_equal(x, y)
        for x, y in zip((a.members, a.nonmembers, a.test), (b.members, b.nonmembers, b.test))
    )
    assert not np.array_equal(a.members, c.members)
    allidx = np.concatenate([a.members, a.nonmembers, a.test])
    assert len(set(allidx.tolist())) == 600
    with pytest.raises(UsageError, match="dataset has 1000"):
        split_dataset(1000, 900, 200, 100, seed=0)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_every_example_in_exactly_one_client(scheme):
    labels = np.random.default_rng(0).integers(0, 3, size=600)
    parts = partition(labels, 7, scheme, dirichlet_alpha=0.5, seed=1, min_size=5)
    allp = np.concatenate(parts)
    assert sorted(allp.tolist()) == list(range(600))
    assert min(len(p) for p in parts) >= 5


def test_dirichlet_skew_grows_as_alpha_shrinks():
    labels = np.random.default_rng(0).integers(0, 4, size=4000)
    skews = []
    for a in (100.0, 1.0, 0.1):
        s = np.mean(
            [
                label_skew(labels, partition(labels, 10, "dirichlet", a, seed=s, min_size=1), 4)
                for s in range(5)
            ]
        )
        skews.append(s)
    assert skews[0] < skews[1] < skews[2]
    iid = label_skew(labels, partition(labels, 10, "iid", seed=0), 4)
    assert iid < skews[0] + 0.05


def test_partition_too_small_is_a_clear_error():
    labels = np.zeros(20, dtype=int)
    with pytest.raises(UsageError, match="cannot give"):
        partition(labels, 10, "iid", min_size=3)
    labels = np.repeat(np.arange(5), 20)
    with pytest.raises(UsageError, match="redraw|draws"):
        partition(labels, 20, "dirichlet", dirichlet_alpha=0.01, seed=0, min_size=4, max_tries=3)


def test_local_files(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "good", "label": "pos"}\n{"text": "bad", "label": "neg"}\n')
    ds = load_local(str(p))
    assert ds.label_names == ["neg", "pos"] and list(ds.labels) == [1, 0]
    c = tmp_path / "d.csv"
    c.write_bytes("txt,y\ncaf\xe9,1\nnope,0\n".encode("latin-1"))
    ds = load_local(str(c), text_column="txt", label_column="y")
    assert ds.texts[0] == "café" and ds.label_names == ["0", "1"]
    e = tmp_path / "e.csv"
    e.write_text("")
    with pytest.raises(UsageError, match="empty"):
        load_local(str(e))
    with pytest.raises(UsageError, match="column 'text' not found"):
        load_local(str(c))
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": 1\n')
    with pytest.raises(UsageError, match="invalid JSON"):
        load_local(str(bad))
    with pytest.raises(UsageError, match="unknown dataset"):
        load_dataset("nope")


def test_csv_rows_longer_than_the_header(tmp_path):
    # found by fuzzing: csv.DictReader keys extra fields under None
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2,3\n")
    with pytest.raises(UsageError, match="column 'text' not found"):
        load_local(str(p))
    q = tmp_path / "y.csv"
    q.write_text("text,label\nhello,1,extra\nbye,0\n")
    ds = load_local(str(q))
    assert ds.texts == ["hello", "bye"]


def test_synthetic_text_is_the_documented_draw():
    """make_synthetic against a slow obvious reference of its recipe (one class draw, 6-13
    filler words, one of the class's markers inserted at a drawn position), over seeds and
    class counts: the arrays it builds once draw the same words as lists would."""
    from fl.data.datasets import make_synthetic

    def reference(n, k, seed):
        rng = np.random.default_rng(seed)
        filler = [f"w{i}" for i in range(200)]
        markers = [[f"c{c}m{j}" for j in range(5)] for c in range(k)]
        texts, labels = [], []
        for _ in range(n):
            y = int(rng.integers(k))
            words = list(rng.choice(filler, size=int(rng.integers(6, 14))))
            words.insert(int(rng.integers(len(words) + 1)), str(rng.choice(markers[y])))
            texts.append(" ".join(words))
            labels.append(y)
        return texts, labels

    for n, k, seed in ((1200, 2, 1234), (300, 3, 0), (50, 4, 7)):
        ds = make_synthetic(n, k, seed)
        texts, labels = reference(n, k, seed)
        assert ds.texts == texts and ds.labels.tolist() == labels
