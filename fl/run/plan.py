"""The run's privacy plan, as a part of :class:`fl.run.engine.Engine`: who takes part and
what it costs. Per client: its public size, local steps and DP-SGD parameters; per
run: σ and δ (calibrated to the target ε), the ledger and its participation note; per
round: the cohort (from the secret stream ``cohort``) and the events it will charge.

:class:`PrivacyPlan` is a mixin: it reads the engine's attributes (``cfg``,
``public_sizes``, ``client_positions``, ``method``, ``rand``) and sets ``sigma``,
``delta``, ``ledger`` and ``participation_note`` on it. It does not import the engine
(the engine imports this module).
"""

from __future__ import annotations

import math

from fl.errors import UsageError
from fl.methods.rounds import RoundInfo
from fl.privacy import rng as R
from fl.privacy.accounting import (
    Event,
    calibrate_client_level,
    calibrate_noise,
    client_level_event,
)
from fl.privacy.dpsgd import DpSgdParams
from fl.privacy.ledger import Ledger


class PrivacyPlan:
    """Engine methods for DP: per-client rates and steps, σ/δ set-up, ledger events,
    client sampling."""

    # ---- privacy -----------------------------------------------------------------
    def client_ids(self) -> list[str]:
        return list(self.client_positions)

    def public_size(self, cid: str) -> int:
        """A client's member count before canaries are added: its sampling rate
        q = B/n and step count use it, so the public rates do not reveal how many
        secret canaries a client received (each example, canary or not, is still in a
        batch with probability q)."""
        return self.public_sizes[cid]

    def local_steps_for(self, n: int) -> int:
        cfg = self.cfg
        if cfg.local_epochs > 0:
            return max(1, math.ceil(cfg.local_epochs * n / cfg.batch_size))
        return cfg.local_steps

    def mechanism_of(self, n: int) -> tuple[float, int]:
        """(q, steps per round) of a client of public size n: q = min(1, B/n)."""
        return min(1.0, self.cfg.batch_size / n), self.local_steps_for(n)

    def sigma_for(self, n: int) -> float:
        """σ of a client of public size n (sample level: calibrated to its own q and
        steps, see :meth:`_setup_privacy`); the run's σ otherwise."""
        table = getattr(self, "mechanism_sigmas", None)
        if self.cfg.dp_level == "sample" and table:
            return table[self.mechanism_of(n)]
        return self.sigma

    def dp_params_for(self, n: int) -> DpSgdParams | None:
        if self.cfg.dp_level != "sample":
            return None
        q = min(1.0, self.cfg.batch_size / n)
        return DpSgdParams(
            self.sigma_for(n), self.cfg.clip, q, q * n, head_share=self.cfg.head_clip_share
        )

    def client_sigmas(self) -> dict[str, float]:
        """σ_k of every client (sample level), by client id."""
        return {c: self.sigma_for(n) for c, n in self.public_sizes.items()}

    def expected_clients_per_round(self) -> float:
        cfg, K = self.cfg, self.cfg.clients
        cpr = cfg.clients_per_round
        if cpr == 0:
            return float(K)
        return float(cpr * K) if cpr < 1 else float(cpr)

    def client_rate(self) -> float:
        return self.expected_clients_per_round() / self.cfg.clients

    def _default_delta(self) -> float:
        n = self.cfg.members if self.cfg.dp_level == "sample" else self.cfg.clients
        return min(1e-5, 1.0 / (10.0 * n))

    def _setup_privacy(self) -> None:
        cfg = self.cfg
        level = cfg.dp_level
        if level == "none":
            self.sigma = 0.0
            self.delta = cfg.delta or 1e-5
            self.ledger = Ledger("none", self.delta)
            self.participation_note = "no DP: nothing is accounted"
            return
        n_pop = cfg.members if level == "sample" else cfg.clients
        self.delta = cfg.delta if cfg.delta > 0 else self._default_delta()
        if self.delta >= 1.0 / n_pop:
            raise UsageError(
                f"delta={self.delta:g} is >= 1/n = {1.0 / n_pop:g} (n = {n_pop} "
                f"{'examples' if level == 'sample' else 'clients'}); such a δ allows releasing a record"
            )
        if level == "sample":
            # Each client is calibrated to its own mechanism (its q_k = B/n_k and steps),
            # for the worst case of taking part in every round; the reported ε composes
            # only the rounds each client actually took part in.
            mechs = sorted({self.mechanism_of(n) for n in self.public_sizes.values()})
            if cfg.epsilon > 0:
                self.mechanism_sigmas = {
                    (q, s): calibrate_noise(
                        cfg.epsilon, q, s * cfg.rounds, self.delta, cfg.accountant
                    )
                    for q, s in mechs
                }
            else:
                self.mechanism_sigmas = {m: cfg.noise_multiplier for m in mechs}
            self.sigma = max(self.mechanism_sigmas.values())
            self.participation_note = (
                "sample-level: an example lives on one client, so its privacy loss composes "
                "only that client's DP-SGD steps (the other clients' releases do not depend "
                "on it). Each client k is calibrated to its own sampling rate q_k = B/n_k and "
                "step count, so that every client meets the target ε (σ_k depends on n_k, "
                "which the public q_k already discloses); no amplification by client sampling "
                "is claimed. σ_k assumes the client takes part in every round; the reported ε "
                "is the maximum over clients of the composition over the rounds each actually "
                "took part in."
            )
        else:
            releases = self.method.client_dp_releases()
            scheme, m, K = self.client_scheme()
            q = m / K if scheme == "poisson" else 1.0
            self.client_level_rate = q
            if cfg.epsilon > 0:
                self.sigma = calibrate_client_level(
                    cfg.epsilon, scheme, m, K, releases * cfg.rounds, self.delta, cfg.accountant
                )
            else:
                self.sigma = cfg.noise_multiplier
            how = {
                "poisson": f"Clients are Poisson-sampled with rate q={q:g} and the amplification "
                "by that sampling is used.",
                "all": "Every client takes part in every round: each release is a Gaussian of "
                "sensitivity C (no amplification).",
                "uniform": f"A fixed count of {m:g} of {K} clients is drawn each round without "
                "replacement: under add/remove an added client can displace another, so each "
                "release is accounted with sensitivity 2C (multiplier σ/2) and no amplification.",
            }[scheme]
            self.participation_note = (
                "client-level: neighbouring = one client's whole data added or removed; every "
                f"round makes {releases} Gaussian release(s) of the clipped client updates. " + how
            )
        self.ledger = Ledger(level, self.delta, budget=cfg.epsilon if cfg.epsilon > 0 else None)

    def client_scheme(self) -> tuple[str, float, int]:
        """(scheme, clients per round, total clients) of the client-level accounting:
        ``poisson`` (expected count), ``all`` (every client, every round) or ``uniform``
        (a fixed count drawn without replacement)."""
        K = self.cfg.clients
        m = self.expected_clients_per_round()
        if self.cfg.client_sampling == "poisson":
            return ("poisson", m, K) if m < K else ("all", K, K)
        m = int(round(m))
        return ("uniform", m, K) if m < K else ("all", K, K)

    def client_level_event(self, r: int, count: int, sigma=None, stage: str = "") -> Event:
        scheme, m, K = self.client_scheme()
        return client_level_event(
            scheme,
            m,
            K,
            self.sigma if sigma is None else sigma,
            count,
            round=r,
            stage=stage,
            note="server-side Gaussian on clipped client updates",
        )

    def record_client_level(self, rnd: RoundInfo, stage: str, count: int, sigma=None) -> None:
        self.ledger.record(self.client_level_event(rnd.index, count, sigma, stage))

    def planned_client_event(self, rnd: RoundInfo | int, cid: str, stage: str = "train"):
        """The DP-SGD event a client's local training makes (sample level), from what
        the server knows (σ, the client's q and steps); None without sample-level DP."""
        if self.cfg.dp_level != "sample":
            return None
        r = rnd.index if isinstance(rnd, RoundInfo) else int(rnd)
        n = self.public_size(cid)
        dp = self.dp_params_for(n)
        return Event(
            "poisson_gaussian" if dp.sample_rate < 1 else "gaussian",
            dp.noise_multiplier,
            dp.sample_rate,
            self.local_steps_for(n),
            unit=f"client:{cid}",
            round=r,
            stage=stage,
            note="DP-SGD local steps",
        )

    def _planned_events(self, rnd: int, clients: list[str]) -> list[Event]:
        if self.cfg.dp_level == "sample":
            return [self.planned_client_event(rnd, c) for c in clients]
        if self.cfg.dp_level == "client":
            return [self.client_level_event(rnd, self.method.client_dp_releases())]
        return []

    # ---- client sampling ---------------------------------------------------------
    def sample_clients(self, rnd: int) -> list[str]:
        """The round's cohort, from the secret stream ``cohort`` (amplification by
        client sampling holds only if the cohort cannot be predicted)."""
        cfg = self.cfg
        ids = self.client_ids()
        m = int(round(self.expected_clients_per_round()))
        if cfg.client_sampling != "poisson" and m >= len(ids):
            return ids
        src = self.rand.round_stream("cohort", rnd)
        if cfg.client_sampling == "poisson":
            keep = R.bernoulli_mask(src, len(ids), self.client_rate())
            return [c for c, k in zip(ids, keep.tolist()) if k]
        return [ids[i] for i in R.random_subset(src, len(ids), m)]
