"""Flower's DP paths audited end to end: the cases of the library benchmark (#43).

``python -m benchmarks.auditing.libraries_flower [--quick]`` prints one line per case.
Each case trains logistic regression (numpy) on synthetic data: 10 clients, 20 rounds
(10 with ``quick``), 16 canary clients, cohorts of m = 6 of the 26 nodes, in this process.
"""

from __future__ import annotations

import sys
import time

import numpy as np

#: (mode, kind, what)
CASES = [
    (
        "legacy_server_fixed",
        "correct",
        "legacy DifferentialPrivacyServerSideFixedClipping + FedAvg, equal client sizes",
    ),
    (
        "legacy_client_fixed",
        "correct",
        "legacy DifferentialPrivacyClientSideFixedClipping + fixedclipping_mod",
    ),
    (
        "message_server_fixed",
        "correct",
        "Message API server-side fixed clipping, Flower's RDP accountant on",
    ),
    (
        "message_client_fixed",
        "correct",
        "Message API client-side fixed clipping + fixedclipping_mod",
    ),
    (
        "legacy_server_adaptive",
        "library flaw",
        "legacy server-side adaptive clipping, C rising (updates below C), claimed at the "
        "nominal σ: Flower noises at the next clip, which can fall on other data",
    ),
    (
        "message_client_adaptive",
        "library flaw",
        "Message API client-side adaptive clipping, C rising, claimed at the nominal σ",
    ),
    (
        "legacy_local_dp",
        "correct",
        "legacy FedAvg + flwr.client.mod.LocalDpMod (C = 1, sensitivity 2C, ε = 1 per "
        "release), claimed composed over the rounds",
    ),
    (
        "legacy_client_adaptive",
        "library flaw",
        "legacy client-side adaptive clipping + adaptiveclipping_mod, C rising, claimed at the "
        "nominal σ",
    ),
    (
        "message_local_dp",
        "correct",
        "Message API LocalDpMod (C = 1, sensitivity 2C, ε = 1 per release, δ = 1e-5), "
        "claimed composed over the rounds",
    ),
    (
        "legacy_unequal_weights",
        "misuse",
        "legacy server-side fixed + FedAvg, client sizes 20…400 (weights n_k/Σn)",
    ),
    ("sigma_halved", "misuse", "the strategy built with σ/2 after the claim said σ"),
    (
        "seeded_clients",
        "misuse",
        "clients call np.random.seed(0) in train: the server's noise repeats each round",
    ),
    (
        "adaptive_shrinking",
        "misuse",
        "adaptive clipping whose C falls: Flower noises at C_(t+1) < C_t",
    ),
    (
        "client_side_without_mod",
        "misuse",
        "Message API client-side fixed clipping, fixedclipping_mod left out",
    ),
    (
        "claims_flower_epsilon",
        "misuse",
        "the claim states the ε of Flower's accountant (σ per round, no displacement)",
    ),
    (
        "local_dp_sensitivity",
        "misuse",
        "LocalDpMod given sensitivity = C and ε = 4 (classic calibration off its range)",
    ),
]

#: (misuse, reason no audit of the release can see it)
UNDETECTABLE = [
    (
        "the clipped-count noise of adaptive clipping set below Flower's σ_b",
        "the noised count stays in the server's state; only the next clip is released, and one "
        "scalar per round is too little to test a noise scale",
    ),
    (
        "a client that reports a false num_examples to raise its weight",
        "the canaries see the weight their own reports get; a real client's inflated report "
        "weighs the real data, which the block does not carry (the white-box weights show it)",
    ),
    (
        "noise drawn from a generator an adversary can seed (e.g. a fixed np.random.seed at start)",
        "one fresh-looking Gaussian draw per round is what the release shows either way; only "
        "a seed that repeats within the run shows (the seeded_clients case)",
    ),
]

K, M, ROUNDS, DIM = 10, 16, 20, 8


def _data(sizes, seed):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=DIM)
    out = []
    for n in sizes:
        x = rng.normal(size=(n, DIM))
        y = (x @ w + 0.5 * rng.normal(size=n) > 0).astype(np.float64)
        out.append((x, y))
    return out


def _sgd(arrays, x, y, seed_each=False):
    if seed_each:
        np.random.seed(0)  # the misuse: resets the process's global generator
    w, b = arrays[0].astype(np.float64).copy(), arrays[1].astype(np.float64).copy()
    for _ in range(2):
        p = 0.5 * (1 + np.tanh((x @ w + b[0]) / 2))  # the logistic, no overflow
        w -= 0.5 * x.T @ (p - y) / len(y)
        b -= 0.5 * np.mean(p - y)
    return [w, b]


def _legacy_client_fn(data, seed_each=False):
    from flwr.client import NumPyClient

    class C(NumPyClient):
        def __init__(self, i):
            self.i = i

        def fit(self, parameters, config):
            x, y = data[self.i]
            return _sgd(parameters, x, y, seed_each), len(y), {}

    def client_fn(ctx):
        # flwr 1.8, 1.9 call client_fn(cid), the partition index as a string; later a Context
        i = int(ctx) if isinstance(ctx, str) else int(ctx.node_config["partition-id"])
        return C(i).to_client()

    return client_fn


def _message_train(data, seed_each=False):
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    def train(msg, ctx):
        x, y = data[int(ctx.node_config["partition-id"])]
        (akey,) = list(msg.content.array_records)
        new = _sgd(msg.content[akey].to_numpy_ndarrays(), x, y, seed_each)
        rec = ArrayRecord({k: Array(v) for k, v in zip(msg.content[akey].keys(), new, strict=True)})
        return Message(
            RecordDict({"arrays": rec, "metrics": MetricRecord({"num-examples": len(y)})}),
            reply_to=msg,
        )

    return train


def claim_for(sigma, rounds, m=6, clip=None, total=K, delta=1e-5, eps=None) -> dict:
    """A client-level claim of a fixed cohort of m; its ε is the one check_claim recomputes
    for it (an honest claim) unless ``eps`` is given."""
    from audit.claims.check import check_claim

    c = {
        "level": "client",
        "noise_multiplier": sigma,
        "sampling": "fixed_batch",
        "rounds": rounds,
        "clients_per_round": m,
        "total_clients": total,
        "claimed_epsilon": 1.0,
        "delta": delta,
        "noise_source": "csprng",
    }
    if clip is not None:
        c["clipping_norm"] = clip
    c["claimed_epsilon"] = eps if eps is not None else float(check_claim(c)["epsilon_pld"])
    return c


def build(mode: str, quick: bool = False, seed: int = 0) -> dict:
    """The strategy, the clients and the claim of one case (keyword arguments of
    :func:`audit.libraries.flower.audit_flower`)."""
    from audit.libraries.flower.compat import check_version

    check_version()  # a release below the audit's range: its clear error, before any import

    rounds = 10 if quick else ROUNDS
    m, pool = 6, K + M
    sigma, clip = 4.0, 0.5
    sizes = (
        [200] * K
        if mode != "legacy_unequal_weights"
        else [20, 30, 40, 50, 60, 80, 100, 150, 250, 400]
    )
    data = _data(sizes, seed)
    legacy = mode.startswith("legacy") or mode in (
        "sigma_halved",
        "seeded_clients",
        "adaptive_shrinking",
    )
    seed_each = mode == "seeded_clients"
    frac = m / pool
    # only the API the case uses: the legacy one exists from 1.8, the Message API from 1.21
    if legacy:
        import flwr.client.mod as lmod
        import flwr.server.strategy as ls

        lib = ls
        inner = ls.FedAvg(
            fraction_fit=frac, min_fit_clients=m, min_available_clients=m, fraction_evaluate=0.0
        )
    else:
        import flwr.clientapp.mod as mmod
        import flwr.serverapp.strategy as ms

        lib = ms
        inner = ms.FedAvg(
            fraction_train=frac, min_train_nodes=m, min_available_nodes=m, fraction_evaluate=0.0
        )
    mods: list = []
    claim = claim_for(sigma, rounds, m, clip)
    if mode in ("legacy_server_fixed", "legacy_unequal_weights", "seeded_clients"):
        strategy = lib.DifferentialPrivacyServerSideFixedClipping(inner, sigma, clip, m)
    elif mode == "sigma_halved":
        strategy = lib.DifferentialPrivacyServerSideFixedClipping(inner, sigma / 2, clip, m)
    elif mode in ("legacy_client_fixed", "message_client_fixed", "client_side_without_mod"):
        strategy = lib.DifferentialPrivacyClientSideFixedClipping(inner, sigma, clip, m)
        if mode != "client_side_without_mod":
            mods = [lmod.fixedclipping_mod if legacy else mmod.fixedclipping_mod]
    elif mode in ("message_server_fixed", "claims_flower_epsilon"):
        from flwr.supercore.privacy_accounting import (
            NeighboringRelation,
            PrivacyConfig,
            SamplingMethod,
        )
        from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

        acc = RdpAccountant(
            PrivacyConfig(
                target_delta=1e-5,
                population_size=pool,
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                sampling_method=SamplingMethod.NO_AMPLIFICATION,
            )
        )
        strategy = ms.DifferentialPrivacyServerSideFixedClipping(
            inner, sigma, clip, m, accountant=acc
        )
        if mode == "claims_flower_epsilon":  # what Flower's accountant will say after the run
            from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

            probe = RdpAccountant(acc.config)
            probe.compose(GaussianPrivacyEvent(sigma, m, pool), rounds)
            claim = claim_for(sigma, rounds, m, clip, eps=probe.get_epsilon(1e-5))
    elif mode in (
        "legacy_server_adaptive",
        "legacy_client_adaptive",
        "message_client_adaptive",
        "adaptive_shrinking",
    ):
        # rising: C starts above the updates' norms and the target quantile is high (few
        # clipped, C grows every round); shrinking: C far below the norms (all clipped)
        rising = mode != "adaptive_shrinking"
        client_side = mode.endswith("client_adaptive")
        cls = (
            lib.DifferentialPrivacyClientSideAdaptiveClipping
            if client_side
            else lib.DifferentialPrivacyServerSideAdaptiveClipping
        )
        # Flower needs σ < 2σ_b; the count's noise σ_b/m moves C either way: rising needs it
        # small (σ = 1, σ_b = 0.6), so the claim is at σ = 1
        sigma = 1.0 if rising else sigma
        strategy = cls(
            inner,
            sigma,
            m,
            initial_clipping_norm=20.0 if rising else 0.05,
            target_clipped_quantile=0.9 if rising else 0.5,
            clipped_count_stddev=0.6 if rising else 3.0,
        )
        if client_side:
            mods = [lmod.adaptiveclipping_mod if legacy else mmod.adaptiveclipping_mod]
        claim = claim_for(sigma, rounds, m)
    elif mode in ("message_local_dp", "legacy_local_dp", "local_dp_sensitivity"):
        strategy = inner
        cls = lmod.LocalDpMod if legacy else mmod.LocalDpMod
        if mode != "local_dp_sensitivity":
            mod = cls(clipping_norm=1.0, sensitivity=2.0, epsilon=1.0, delta=1e-5)
        else:
            mod = cls(clipping_norm=1.0, sensitivity=1.0, epsilon=4.0, delta=1e-5)
        mods = [mod]
        std = mod.sensitivity * np.sqrt(2 * np.log(1.25 / mod.delta)) / mod.epsilon
        # the claim composes a client's releases over every round (it may be drawn in each),
        # at the mod's own sensitivity (2C in the correct cases: any two inputs of a client)
        from audit.bounds.hypothesis import gdp_epsilon

        eps = gdp_epsilon(np.sqrt(rounds) * mod.sensitivity / std, mod.delta)
        claim = claim_for(std / mod.clipping_norm, rounds, m, eps=eps)
    else:
        raise ValueError(f"unknown case {mode!r}; known: {[c[0] for c in CASES]}")
    kw = (
        {"client_fn": _legacy_client_fn(data, seed_each)}
        if legacy
        else {"train": _message_train(data, seed_each)}
    )
    return {
        "strategy": strategy,
        "mods": mods,
        "num_clients": K,
        "initial_arrays": [np.zeros(DIM), np.zeros(1)],
        "rounds": rounds,
        "claim": claim,
        **kw,
    }


def run_case(mode: str, seed: int = 0, quick: bool = False, permutations: int = 19_999) -> dict:
    """One case: the audit's dict plus ``case``, ``wall_s``, ``version``."""
    import flwr

    from audit.libraries.flower import FlowerCanaries, audit_flower

    t0 = time.time()
    kw = build(mode, quick=quick, seed=seed)
    res = audit_flower(
        **kw,
        canaries=FlowerCanaries(m=M, seed=seed),
        seed=seed,
        permutations=permutations,
    )
    return {**res, "case": mode, "wall_s": time.time() - t0, "version": flwr.__version__}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quick = "--quick" in argv
    for mode, kind, _what in CASES:
        r = run_case(mode, quick=quick)
        ratio = r["conformance"]["tests"][0].get("observed_over_claimed")
        print(
            f"{mode:26s} {kind:8s} {r['verdict']:4s} ε claim {r['claimed_epsilon']:.3g} "
            f"recomputed {r['recomputed_epsilon']:.3g} lb {r['epsilon_lower_bound']} "
            f"noise obs/claimed {ratio:.3f} findings {[f['code'] for f in r['findings']]} "
            f"{r['wall_s']:.1f}s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
