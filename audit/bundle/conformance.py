"""A run's conformance audit: its gradient canaries' privatized step sums tested against the
claimed mechanism (:mod:`audit.bounds.conformance`), and the noise-implied ε.

What is tested is the *claim*, not the run's own record of itself: σ comes from the ledger's
event of each client and round (the mechanism the ε was computed from), C from the
manifest's clipping norm, the coins are drawn again from the run's key (the auditor's own
draw), and the inclusion bits from ``splits.json``. The σ, C and q written in the
observation files are the trainer's word and are used only to find the coin stream (its
rate) and to report a disagreement.

The noise-implied ε is the ledger's ε with every DP-SGD event's σ multiplied by the worst
group's upper confidence bound on the observed noise factor (capped at 1): the ε the run
has *if* its noise is Gaussian at the observed scale. It is labelled as conditional on that;
it is not a certified lower bound (that is the one-run bound beside it).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from audit.bounds.conformance import (
    ALPHA,
    TESTS,
    Block,
    GroupTest,
    conformance,
    implied_noise_factor,
)
from audit.bounds.contribution import clip_contribution_test
from audit.bounds.sampling import sampling_test
from audit.claims.implied import epsilon_of_scaled_events
from audit.findings import Code, Findings
from fl.privacy import gradient_canaries as G
from fl.privacy import rng as R
from fl.privacy import sampler_canaries as SC
from fl.privacy.accounting import Event

__all__ = [
    "coin_stream",
    "gradient_blocks",
    "implied_epsilon",
    "run_conformance",
    "sampler_test",
]


#: the sampler canaries' test, beside the conformance tests of audit.bounds.conformance
SAMPLING_TEST = (
    "the batches are Poisson-sampled: each sampler canary's appearances are exchangeable over "
    "the steps (a permutation test)"
)


#: the two-sided clip test (:func:`audit.bounds.contribution.clip_contribution_test`)
CONTRIBUTION_TEST = (
    "a drawn canary adds EXACTLY C, as the step's clip of each example gives it: two-sided, "
    "for any data gradient"
)


def coin_stream(run: Path, manifest: dict):
    """The run's stream factory ``stream(*parts)`` for re-drawing the canaries' coins: the
    key's (``private/noise.key``) for a keyed run, the public seed's for a seeded one; None
    when neither is available (the clipping test is then skipped)."""
    noise = (manifest.get("privacy") or {}).get("noise") or {}
    cfg = manifest.get("config") or {}
    if noise.get("source") == "seeded" or cfg.get("insecure_deterministic_noise"):
        seed = int(cfg.get("seed", 0))
        return lambda *parts: R.SeededSource(seed, parts)
    key_file = run / R.PRIVATE_DIR / R.KEY_FILE
    if key_file.is_file():
        key = R.NoiseKey.read(key_file)
        return key.stream
    return None


def _ledger_sigma(manifest: dict) -> dict[tuple[str, int, str], float]:
    """(client, round, stage) → σ of the ledger's DP-SGD event."""
    out = {}
    for e in ((manifest.get("privacy") or {}).get("ledger") or {}).get("events") or []:
        unit = str(e.get("unit", ""))
        if unit.startswith("client:"):
            out[(unit.split(":", 1)[1], int(e.get("round", -1)), str(e.get("stage", "")))] = float(
                e["noise_multiplier"]
            )
    return out


def gradient_blocks(
    records: list[dict], observations: list[dict], manifest: dict, stream
) -> tuple[list[Block], list[str]]:
    """One :class:`Block` per observation file, and notes (disagreements between the file's
    σ, C, q and the claim's)."""
    priv = manifest.get("privacy") or {}
    clip = float(priv.get("clipping_norm") or 0) or None
    rates = {str(k): float(v) for k, v in (priv.get("sample_rates") or {}).items()}
    sigmas = _ledger_sigma(manifest)
    notes: list[str] = []
    blocks = []
    for ob in observations:
        ids = np.asarray(ob["ids"], dtype=np.int64)
        if ids.size == 0:
            continue
        obs = np.asarray(ob["obs"], dtype=np.float64).reshape(-1, len(ids))
        if ids.min() < 0 or ids.max() >= len(records):
            raise ValueError(f"{ob.get('file')}: canary ids outside the canary set")
        cid, rnd, stage = str(ob["client"]), int(ob["round"]), str(ob["stage"])
        sigma = sigmas.get((cid, rnd, stage))
        if sigma is None:
            sigma = float(ob["sigma"])
            notes.append(
                f"{ob.get('file')}: no ledger event for client {cid}, round {rnd}; σ from the file"
            )
        elif not math.isclose(sigma, float(ob["sigma"]), rel_tol=1e-6):
            notes.append(
                f"{ob.get('file')}: the file states σ = {float(ob['sigma']):.6g}, the ledger "
                f"{sigma:.6g}; tested against the ledger's"
            )
        c = clip or float(ob["clip"])
        if clip is not None and not math.isclose(clip, float(ob["clip"]), rel_tol=1e-9):
            notes.append(
                f"{ob.get('file')}: the file states C = {ob['clip']:g}, the manifest {clip:g}"
            )
        q = rates.get(cid, float(ob["q"]))
        coins = G.observation_coins(stream, records, ob) if stream is not None else None
        space = str(ob.get("space", "flat"))
        groups = np.array(
            [
                (g + " (W-space)") if space == "w" and g == "B" else g
                for g in (G.group_of(records[j]["param"]) for j in ids)
            ]
        )
        blocks.append(
            Block(
                u=obs / c,
                tracks=ids,
                groups=groups,
                sigma=sigma,
                included=np.array([bool(records[j]["included"]) for j in ids]),
                coins=coins,
                q=q,
                order=(rnd, int(ob.get("attempt", 0)), stage, cid),
            )
        )
    return blocks, notes


def implied_epsilon(manifest: dict, factor: float, delta: float) -> tuple[float, bool]:
    """(ε, at_least): the ledger's ε (max over accounting units, PLD) with every event's σ
    multiplied by ``factor`` (the noise-implied ε; ``factor`` 0 → ∞), by the shared core
    :func:`audit.claims.implied.epsilon_of_scaled_events` (``at_least``: an effective σ was
    raised to its floor, so the figure is a lower bound on the implied ε)."""
    by_unit: dict[str, list[Event]] = {}
    for e in ((manifest.get("privacy") or {}).get("ledger") or {}).get("events") or []:
        ev = Event.from_dict(e)
        by_unit.setdefault(ev.unit, []).append(ev)
    return epsilon_of_scaled_events(by_unit.values(), factor, delta)


def sampler_test(
    run: Path, manifest: dict, permutations: int = 19_999
) -> tuple[GroupTest | None, dict | None]:
    """The permutation test of the run's sampler canaries (:mod:`audit.bounds.sampling`) as
    one more test of the family, with σ from the ledger and q from the manifest (the claim),
    at most ``permutations`` of them; (None, None) when the run has none."""
    obs = SC.read_observations(run)
    if not obs:
        return None, None
    priv = manifest.get("privacy") or {}
    rates = {str(k): float(v) for k, v in (priv.get("sample_rates") or {}).items()}
    sigmas = _ledger_sigma(manifest)
    clip = float(priv.get("clipping_norm") or 0) or None
    blocks = []
    for ob in obs:
        c = clip or ob["clip"]
        sigma = sigmas.get((ob["client"], ob["round"], ob["stage"]), ob["sigma"])
        blocks.append((ob["obs"] / c, sigma, rates.get(ob["client"], ob["q"])))
    res = sampling_test(blocks, permutations=permutations)
    t = GroupTest(
        group="sampler",
        test="sampling",
        terms=res.canaries,
        statistic=res.z_phase,
        log10_p=math.log10(res.p_value),
        note=f"window z {res.z_window:.3g}, phase z {res.z_phase:.3g}",
    )
    return t, res.to_dict()


def run_conformance(
    run: Path,
    manifest: dict,
    records: list[dict] | None,
    delta: float,
    findings: Findings,
) -> dict:
    """The conformance tests of a run's gradient canaries (``records``; None when it has
    none: scale, freshness, the one-sided clip test and the two-sided ``contribution``, a
    drawn canary adds exactly C) and sampler canaries, Holm-corrected together; its
    noise-implied ε; and a ``mechanism_mismatch`` finding per rejected test."""
    blocks, notes, stream = [], [], None
    if records:
        obs = G.read_observations(run)
        stream = coin_stream(Path(run), manifest)
        blocks, notes = gradient_blocks(records, obs, manifest, stream)
    # the sampler test's Monte Carlo floor 1/(P + 1) must reach Holm's smallest threshold
    # α/k with room for a few exceedances: k counts at most four tests per observed group
    # (scale, fresh, clip, contribution) and the sampler test itself; P = 2k/α − 1, at
    # most 19 999
    k = 4 * len({str(g) for b in blocks for g in np.unique(b.groups)}) + 1
    p_max = min(19_999, math.ceil(2 * k / ALPHA) - 1)
    samp, samp_res = sampler_test(Path(run), manifest, permutations=p_max)
    # the two-sided clip test: the engine adds each sampled included canary's clipped
    # K·C·e_j (C exactly) to the clipped sum of the data's per-example clips, drawn
    # independently of its coin: a drawn canary adds exactly C (not only at most)
    extra = clip_contribution_test(blocks) + ((samp,) if samp is not None else ())
    res = conformance(blocks, extra=extra)
    factor, group = implied_noise_factor(res)
    eps_implied, at_least = implied_epsilon(manifest, factor, delta)
    if not blocks:  # no observation of the noise (sampler canaries only): nothing implied
        factor, group, eps_implied, at_least = None, None, None, False
    for t in res.rejected + res.weak:
        if t.test == "sampling":
            seen = f"{t.note}; count dispersion {samp_res['count_dispersion']:.3g} (Poisson: 1)"
            seen = f"p = {t.p_value:.3g}; {seen}"
            what = SAMPLING_TEST
        else:
            seen, what = t.evidence(), {**TESTS, "contribution": CONTRIBUTION_TEST}[t.test]
        if t.rejected:
            findings.add(
                Code.MECHANISM_MISMATCH,
                f"Group {t.group}, {t.test} test ({what}): rejected at family-wise "
                f"α = {res.alpha:g} (Holm), {seen}. The run does not implement "
                "the mechanism its ε was computed for.",
            )
        else:
            findings.add(
                Code.CONFORMANCE_WEAK,
                f"Group {t.group}, {t.test} test ({what}): rejected at family-wise "
                f"α = {res.warn_alpha:g} but not at the verdict's α = {res.alpha:g} (Holm), "
                f"{seen}. Weak evidence that the run departs from its claim: one correct run "
                f"in {1 / res.warn_alpha:.0f} can show it; audit a longer run or more canaries "
                "to settle it.",
            )
    out = res.to_dict()
    out.update(
        {
            "implied_factor": factor,
            "implied_factor_group": group,
            "implied_epsilon": eps_implied,
            "implied_epsilon_at_least": at_least,
            "implied_note": "the ledger's ε with σ times the worst group's upper confidence "
            "bound on the observed noise factor (capped at 1): conditional on the noise being "
            "Gaussian at the observed scale; not a certified bound",
            "coins": "re-drawn from the run's key" if stream is not None else "unknown",
            "notes": notes,
            "blocks": len(blocks),
            "sampling": samp_res,
        }
    )
    return out
