"""A run's one-run audit (``fedlora audit RUN --one-run``): its canaries scored (input
canaries by their loss under the released adapter, gradient canaries from the privatized
step sums, canary clients at client level), Steinke et al.'s and the f-DP one-run bounds,
the claim check against the recomputed ε, and the conformance tests with the noise-implied ε
(:mod:`audit.bundle.conformance`). Called by :func:`audit.bundle.audit.audit_run`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from audit.bundle.reading import read_manifest
from audit.findings import Code, Findings
from fl.errors import UsageError

__all__ = ["canary_scores", "claim_check", "fdp_summary", "joint_bound", "one_run_audit"]


def canary_scores(run_dir, texts: list[str], labels: list[int], batch_size: int = 64) -> np.ndarray:
    """Membership scores −loss (nats) of ``texts``/``labels`` under the run's released model.

    Loads the base model (same name and seed as the run), the released PEFT adapter
    (LoRA factors + head) and returns the per-example cross-entropy negated, shape (n,).
    """
    import torch

    from fl.models.base import load_base_model, load_tokenizer
    from fl.run.engine import TokenizedData

    run = Path(run_dir)
    m = read_manifest(run)
    cfg = m["config"]
    num_labels = (m.get("data") or {}).get("num_classes")
    if not isinstance(num_labels, int):
        raise UsageError("manifest.json: missing field data.'num_classes'")
    try:  # the attacks package's signals (shared loader, shape checks) when present
        from attacks.signals import adapter_signals
    except ImportError:
        adapter_signals = None
    if adapter_signals is not None:
        sig = adapter_signals(
            run / "adapter",
            cfg["model"],
            list(texts),
            np.asarray(labels, dtype=np.int64),
            int(cfg.get("max_length", 64)),
            device="cpu",
            seed=cfg["seed"],
            num_labels=num_labels,
            batch_size=batch_size,
            progress=False,
        )
        return -np.asarray(sig.loss, dtype=np.float64)
    from peft import PeftModel

    net = load_base_model(cfg["model"], num_labels, seed=cfg["seed"])
    try:
        model = PeftModel.from_pretrained(net, str(run / "adapter"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load the adapter of {run}: {exc}") from None
    model.eval()
    data = TokenizedData(
        list(texts),
        np.asarray(labels, dtype=np.int64),
        load_tokenizer(cfg["model"]),
        int(cfg.get("max_length", 64)),
    )
    losses = []
    with torch.no_grad():
        for s in range(0, len(data), batch_size):
            batch = data.batch(torch.arange(s, min(len(data), s + batch_size)), torch.device("cpu"))
            y = batch.pop("labels")
            logits = model(**batch).logits.float()
            losses.append(torch.nn.functional.cross_entropy(logits, y, reduction="none"))
    return -torch.cat(losses).numpy().astype(np.float64)


def joint_bound(scores, included, delta, alpha) -> tuple[float, str]:
    """The certified one-run bound the claim is tested with: the larger of Steinke et al.'s
    and the f-DP bound (family (ε, δ), valid for any mechanism), each at α/2, so the pair
    holds jointly at 1 − α (union bound). Returns (ε_lb, which bound gave it)."""
    from audit.bounds.fdp import fdp_one_run_bound
    from audit.bounds.one_run import epsilon_one_run

    if not delta < 1:
        return 0.0, "none (δ >= 1)"
    st = float(epsilon_one_run(scores, included, delta, alpha=alpha / 2)["epsilon_lb"])
    fd = float(
        fdp_one_run_bound(scores, included, delta, alpha=alpha / 2, family="dp")["epsilon_lb"]
    )
    return (fd, "f-DP") if fd > st else (st, "Steinke et al.")


def claim_check(m, scores, included, delta, alpha, eps_claim, res) -> dict:
    """What the claim allows for one canary, and the one-run bound to compare with it.

    The bound is the larger of Steinke et al.'s and the f-DP one, each at α/2
    (:func:`joint_bound`: certified at 1 − α jointly). Sample level: a canary is one
    record, the ledger's neighbouring relation (ε, δ). Client level: the ledger is
    add/remove-one-client, and a canary changes one client's data (replace-one-client),
    which group privacy bounds by (2ε, (1 + e^ε)·δ); the bound is recomputed at that δ.
    Comparing a record-level bound with the add/remove ε would flag a correct run that
    leaks less than 2ε."""
    if (m.get("privacy") or {}).get("level") != "client":
        lb, by = joint_bound(scores, included, delta, alpha)
        return {
            "epsilon": eps_claim,
            "delta": delta,
            "epsilon_lb": lb,
            "bound": f"{by} (the larger of Steinke et al. and f-DP, each at α/2)",
            "relation": "one record, the ledger's relation",
            "exceeds": lb > eps_claim,
        }
    d2 = (1 + math.exp(min(eps_claim, 700.0))) * delta
    lb, by = joint_bound(scores, included, d2, alpha)
    return {
        "epsilon": 2 * eps_claim,
        "delta": d2,
        "epsilon_lb": float(lb),
        "bound": f"{by} (the larger of Steinke et al. and f-DP, each at α/2)",
        "relation": "a canary changes one client's data: replace-one-client, "
        "(2ε, (1 + e^ε)δ) by group privacy from the ledger's add/remove-one-client",
        "exceeds": float(lb) > 2 * eps_claim,
    }


def fdp_summary(scores, included, delta, alpha) -> dict:
    """The f-DP one-run bounds at 1 − α (audit.bounds.fdp): family (ε, δ) (valid for any
    mechanism; the figure shown beside Steinke et al.'s) and μ-GDP (μ_lb; its ε reading
    assumes a Gaussian trade-off curve)."""
    from audit.bounds.fdp import fdp_one_run_bound

    dp = fdp_one_run_bound(scores, included, delta, alpha=alpha, family="dp")
    gdp = fdp_one_run_bound(scores, included, delta, alpha=alpha, family="gdp")
    return {
        "epsilon_lb": float(dp["epsilon_lb"]),
        "k_plus": int(dp["k_plus"]),
        "k_minus": int(dp["k_minus"]),
        "correct": int(dp["correct"]),
        "family": "(ε, δ)-DP curves at the run's δ (valid for any mechanism)",
        "mu_lb_gdp": float(gdp["mu_lb"]),
        "epsilon_lb_gdp": float(gdp["epsilon_lb"]),
        "alpha": alpha,
    }


def one_run_audit(
    run: Path, m: dict, splits: dict | None, alpha: float, out: dict, findings: Findings
) -> dict:
    from audit.bounds.one_run import epsilon_one_run
    from audit.canaries import clients as CCA

    canaries = (splits or {}).get("canaries")
    cc_res = None
    if CCA.has_canary_clients(run, m):  # client-level canary clients (Andrew et al. 2024)
        try:
            cc_delta = out["delta"] if out["delta"] else float(m["privacy"].get("delta") or 1e-5)
            cc_res = CCA.audit(run, cc_delta, alpha, out.get("epsilon_pld"))
        except FileNotFoundError as exc:
            raise UsageError(str(exc)) from None
        from audit.bundle.client_conformance import run_client_conformance

        # the mechanism itself: the privatized sums on the canaries' directions
        cc_res["conformance"] = run_client_conformance(run, m, cc_delta, findings)
        cc_res["implied_epsilon"] = cc_res["conformance"]["implied_epsilon"]
        check = cc_res.get("claim_check")
        if check and check["exceeds"]:
            findings.add(
                Code.EMPIRICAL_EXCEEDS_CLAIM,
                f"The canary-client audit bounds ε >= {check['epsilon_lb']:.3g} (at δ = "
                f"{check['delta']:.3g}) with confidence {1 - alpha:g} from {cc_res['m']} "
                f"canary clients, above the recomputed ε = {check['epsilon']:.4g} "
                f"({check['relation']}): the mechanism leaks more than its accounting allows.",
            )
        if not canaries:
            return cc_res
    if not canaries:
        from audit.bundle.conformance import run_conformance
        from fl.privacy import sampler_canaries as SC

        if SC.read_observations(run):  # sampler canaries alone: the sampling test, no bound
            delta = out["delta"] if out["delta"] else float(m["privacy"].get("delta") or 1e-5)
            conf = run_conformance(run, m, None, delta, findings)
            return {
                "kind": "sampler_canaries",
                "conformance": conf,
                "implied_epsilon": None,
                "note": "sampler canaries only: the sampling is tested; no ε lower bound (that "
                "needs membership canaries: --canaries M) and no noise-implied ε (gradient "
                "canaries observe the noise: --canary-kind gradient)",
            }
        raise UsageError(
            f"{run} has no canaries in splits.json; train with `fedlora train --canaries M` "
            "(or, at client level, --canary-clients M)"
        )
    from audit.canaries import gradient as GC

    gradient = GC.is_gradient(canaries)
    fields = ("param", "index", "client", "included") if gradient else ("text", "label", "included")
    for i, c in enumerate(canaries):
        for k in fields:
            if not isinstance(c, dict) or k not in c:
                raise UsageError(f"splits.json: canary {i} is missing field {k!r}")
    delta = out["delta"] if out["delta"] else float(m["privacy"].get("delta") or 1e-5)
    if gradient:  # white-box: the privatized step sums at the canaries' coordinates
        scores, seen = GC.run_scores(run, canaries, GC.DEFAULT_STATISTIC)
        if not seen["files"]:
            raise UsageError(
                f"{run}: gradient canaries but no observations under "
                "private/canary_observations/ (the operator's files are needed)"
            )
    else:
        texts, labels = [c["text"] for c in canaries], [int(c["label"]) for c in canaries]
        scores = canary_scores(run, texts, labels)
    included = np.array([bool(c["included"]) for c in canaries])
    res = epsilon_one_run(scores, included, delta, alpha=alpha)
    res = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in res.items()}
    if gradient:
        from audit.bundle.conformance import run_conformance

        res["kind"] = GC.KIND
        res["statistic"] = GC.DEFAULT_STATISTIC
        res["score"] = GC.STATISTICS[GC.DEFAULT_STATISTIC]
        res["observations"] = seen
        # the mechanism itself, tested from the same observations (audit.bounds.conformance)
        res["conformance"] = run_conformance(run, m, canaries, delta, findings)
        res["implied_epsilon"] = res["conformance"]["implied_epsilon"]
    else:
        res["score"] = "-loss (nats) under the released adapter"
        from audit.bundle.conformance import run_conformance
        from fl.privacy import sampler_canaries as SC

        if SC.read_observations(run):  # sampler canaries beside input canaries: the sampling
            res["conformance"] = run_conformance(run, m, None, delta, findings)
    res["n_included"] = int(included.sum())
    res["fdp"] = fdp_summary(scores, included, delta, alpha)
    eps_claim = out.get("epsilon_pld")
    if isinstance(eps_claim, int | float) and math.isfinite(eps_claim):
        res["claim_check"] = check = claim_check(m, scores, included, delta, alpha, eps_claim, res)
        if check["exceeds"]:
            findings.add(
                Code.EMPIRICAL_EXCEEDS_CLAIM,
                f"The one-run audit bounds ε >= {check['epsilon_lb']:.3g} (at δ = "
                f"{check['delta']:.3g}; {check['bound']}) with confidence {1 - alpha:g} from "
                f"{len(canaries)} canaries, above the {check['epsilon']:.4g} that the recomputed ε = "
                f"{eps_claim:.4g} allows for one canary ({check['relation']}): the mechanism "
                "leaks more than its accounting allows.",
            )
    if cc_res is not None:
        res["canary_clients"] = cc_res
        if cc_res["implied_epsilon"] is not None:
            res.setdefault("implied_epsilon", cc_res["implied_epsilon"])
    return res
