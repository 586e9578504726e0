"""The run's keyed CSPRNG streams (fl.privacy.rng): against a slow reference built
from the primitives, statistically, and the key file's handling."""

import hashlib
import hmac
import math
import os
import stat

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats

from fl.errors import UsageError
from fl.privacy import rng as R


def _reference_normals(secret: bytes, parts: tuple, n: int) -> list[float]:
    """Slow, obvious: HMAC stream key, AES-256-CTR keystream from counter 0, 64-bit
    little-endian words, top 53 bits, Box–Muller pair by pair in Python floats."""
    name = ("[" + ",".join(f'"{p}"' for p in parts) + "]").encode()
    sub = hmac.new(secret, b"fedlora-audit/noise-stream/v1\x00" + name, hashlib.sha256).digest()
    m = (n + 1) // 2
    ks = Cipher(algorithms.AES(sub), modes.CTR(bytes(16))).encryptor().update(bytes(16 * m))
    u = [(int.from_bytes(ks[8 * i : 8 * i + 8], "little") >> 11) / 2.0**53 for i in range(2 * m)]
    first, second = [], []
    for i in range(m):
        r = math.sqrt(-2.0 * math.log(1.0 - u[i]))
        first.append(r * math.cos(2 * math.pi * u[m + i]))
        second.append(r * math.sin(2 * math.pi * u[m + i]))
    return (first + second)[:n]


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_keyed_normals_equal_slow_reference(n):
    secret = bytes(range(32))
    key = R.NoiseKey(secret)
    got = key.stream("dpsgd-noise", 3, "1", "train").normal((n,), 1.0, torch.float64)
    ref = torch.tensor(
        _reference_normals(secret, ("dpsgd-noise", 3, "1", "train"), n), dtype=torch.float64
    )
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)


def test_streams_replay_and_are_independent():
    k = R.NoiseKey.generate()
    a = k.stream("x", 1).normal((64,), 1.0)
    assert torch.equal(a, k.stream("x", 1).normal((64,), 1.0))  # same key, same name
    assert not torch.equal(a, k.stream("x", 2).normal((64,), 1.0))
    assert not torch.equal(a, R.NoiseKey.generate().stream("x", 1).normal((64,), 1.0))
    # draws continue the stream: two halves equal one draw of the whole
    s1, s2 = k.stream("y"), k.stream("y")
    whole = s1.uniform(10)
    assert torch.equal(torch.cat([s2.uniform(4), s2.uniform(6)]), whole)
    # the stream name is unambiguous: ("a,b",) and ("a", "b") differ
    assert not torch.equal(k.stream("a,b").uniform(4), k.stream("a", "b").uniform(4))


def test_distributions():
    s = R.NoiseKey(bytes(range(32))).stream("stats")  # fixed: p-value cut-offs stay reproducible
    z = s.normal((200_000,), 3.0, torch.float64).numpy() / 3.0
    assert stats.kstest(z, "norm").pvalue > 1e-4
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    u = s.uniform(100_000).numpy()
    assert u.min() >= 0 and u.max() < 1
    assert stats.kstest(u, "uniform").pvalue > 1e-4
    m = R.bernoulli_mask(s, 100_000, 0.3).float().mean().item()
    assert abs(m - 0.3) < 0.01
    ints = R.integers(s, 7, 70_000)
    counts = np.bincount(ints, minlength=7)
    assert counts.sum() == 70_000 and stats.chisquare(counts).pvalue > 1e-4


def test_random_subset_is_uniform():
    s = R.NoiseKey(bytes(range(32))).stream("subset")  # fixed: reproducible p-value
    n, m, reps = 6, 2, 6000
    seen = {}
    for _ in range(reps):
        sub = tuple(R.random_subset(s, n, m))
        assert len(set(sub)) == m and list(sub) == sorted(sub)
        seen[sub] = seen.get(sub, 0) + 1
    assert len(seen) == math.comb(n, m)
    assert stats.chisquare(list(seen.values())).pvalue > 1e-4
    with pytest.raises(ValueError):
        R.random_subset(s, 3, 4)


def test_zero_std_draws_nothing_and_bad_std_is_refused():
    k = R.NoiseKey.generate()
    s = k.stream("z")
    assert torch.equal(s.normal((3,), 0.0), torch.zeros(3))
    assert torch.equal(s.uniform(2), k.stream("z").uniform(2))  # stream not advanced
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            s.normal((3,), bad)
    with pytest.raises(ValueError):
        R.draw_normal(None, (2,), 1.0)


def test_seeded_source_is_reproducible_from_the_public_seed():
    a = R.RunRandomness(None, 5, insecure=True).stream("dpsgd-noise", 0, "0", "train")
    b = R.RunRandomness(None, 5, insecure=True).stream("dpsgd-noise", 0, "0", "train")
    assert not a.private
    assert torch.equal(a.normal((10,), 1.0), b.normal((10,), 1.0))
    assert R.RunRandomness(None, 5, insecure=True).describe()["source"] == "seeded"
    with pytest.raises(UsageError):
        R.RunRandomness(None, 5)  # private without a key


def test_key_file(tmp_path):
    k = R.NoiseKey.generate()
    path = k.write(tmp_path)
    assert path == tmp_path / "private" / "noise.key"
    assert stat.S_IMODE(os.stat(tmp_path / "private").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert R.key_file_is_private(path)
    back = R.NoiseKey.read(path)
    assert back.key_id == k.key_id and len(k.key_id) == 32
    assert torch.equal(back.stream("s").uniform(3), k.stream("s").uniform(3))
    assert path.read_text().strip() not in repr(k)  # the secret is never printed
    with pytest.raises(UsageError, match="refusing to overwrite"):
        k.write(tmp_path)
    for bad in ("", "zz" * 32, "ab" * 16, "ab" * 33):
        (tmp_path / "bad.key").write_text(bad)
        with pytest.raises(UsageError, match="hex digits"):
            R.NoiseKey.read(tmp_path / "bad.key")
    (tmp_path / "bin.key").write_bytes(b"\xff\xfe" * 40)
    with pytest.raises(UsageError):
        R.NoiseKey.read(tmp_path / "bin.key")
    with pytest.raises(UsageError, match="not found"):
        R.NoiseKey.read(tmp_path / "missing.key")
    desc = R.RunRandomness(k, 0).describe()
    assert desc["source"] == "keyed_csprng" and desc["key_id"] == k.key_id
    assert path.read_text().strip() not in str(desc)
