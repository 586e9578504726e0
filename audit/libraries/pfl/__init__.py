"""pfl (Apple's pfl-research) audited end to end: canary users that take pfl's own path.

**What travels.** M canary USERS are added to the user's federated data
(:meth:`PflCanaries.users`), so pfl's own user sampler (``FederatedDataset`` with
``get_user_sampler('random' | 'minimize_reuse')``) draws them into its cohorts like every
user. :meth:`PflCanaries.model` wraps the user's torch module (which has pfl's ``loss`` and
``metrics``) with a canary block: a parameter of M coordinates that only canary rows touch
(a forward of exactly zero, a backward of a constant ``gain``), so a canary user's local
training (pfl's ``FederatedAveraging`` and its SGD bridge) moves only its own coordinate,
far past the clipping bound, and a real user's update is exactly 0 on the block. pfl's
central mechanism (``CentrallyAppliedPrivacyMechanism`` over ``GaussianMechanism`` or
``LaplaceMechanism``) clips each canary update to exactly C on its coordinate, pfl's
aggregator sums it with the cohort (after whatever weighting the user put before or after the
mechanism), and pfl's ``add_noise`` noises the block like every parameter.

**Where it is read.** :attr:`PflCanaries.postprocessor`, a pfl ``Postprocessor`` put FIRST in
``SimulatedBackend(postprocessors=[...])``: pfl runs the users' steps in list order and the
server steps in reverse order (aggregate/simulate.py:185-191, 237-242), so its user step sees
which users the sampler drew (the counts k of each canary user per round: the sampler's own
decisions, with-replacement duplicates included) and its server step runs last, on the
mechanism's output: the noised sum, before ``FederatedAveraging`` divides it by the total
weight and the central optimizer applies it. No pfl code is patched. A postprocessor placed
after the mechanism reads the sum before the noise: the data show it (no noise at all) and
the finding names the slip.

**The released model.** :attr:`PflCanaries.callback`, a pfl ``TrainingProcessCallback``
given to ``run(callbacks=[...])``, reads the released model's canary block before training
and after every central iteration; the audit checks that each round's change is a multiple
of the observed noised sum divided by the round's total weight (``FederatedAveraging``'s
average, then a stateless central SGD step: the multiple is its learning rate), so the
release is the mechanism's output post-processed (``released_model``). A central optimizer
with state (momentum, Adam) mixes rounds: the check then says so in ``untested``.

**Inclusion bits and the ε lower bound.** Each canary user enters the population with
probability ``p_include`` = 1/2 (bits from the OS's entropy unless ``seed``); the excluded
canaries' coordinates are observed too. Canary j's score is the sum of its coordinate over
the rounds; the one-run bounds (:mod:`audit.bounds.one_run`, :mod:`audit.bounds.fdp`) are
valid because each canary is one user added or not, the relation of a client-level claim.

**What pfl's accountants assume, and what its simulation samples.** pfl's accountants
(``PLDPrivacyAccountant``, ``RDPPrivacyAccountant``, ``PRVPrivacyAccountant``) compose a
Poisson-subsampled mechanism at ``sampling_probability`` (dp-accounting's ``sampling_prob``,
``PoissonSampledDpEvent``, prv-accountant's ``PoissonSubsampledGaussianMechanism``;
privacy/privacy_accountant.py:227-233, 341-344, 426-429). pfl's simulation never samples
that way: ``FederatedDataset.get_cohort`` calls the user sampler ``cohort_size`` times
(data/federated_dataset.py:445-457), ``'random'`` with replacement
(``user_ids[np.random.randint(...)]``, data/sampling.py:280: a user can be drawn twice in
one cohort and is then trained and summed twice), ``'minimize_reuse'`` cycling in a fixed
order (data/sampling.py:114-141). The audit reads the sampling from the data (duplicates,
cohort sizes, every user every round) and compares it with the claim: a claim of Poisson
sampling (what pfl's accountant gives) for a fixed cohort is a finding. The mechanism that
really ran is recomputed as the toolkit's references go (:mod:`audit.claims.check`): every
user every round (``all``) a plain Gaussian of multiplier σ per round; a fixed cohort drawn
without replacement (``fixed_batch``) a plain Gaussian of multiplier σ/2 per round (an added
user can displace another: sensitivity 2C), no amplification; with replacement the same
figure, marked "at least" (a user drawn k times adds kC, which no reference here covers).

**The tests.** Gaussian: the conformance family (:mod:`audit.bounds.conformance`: scale,
freshness) on the residuals ``u − k`` (observations in units of the claimed C less one C per
draw), with the contribution t-test (:func:`audit.libraries.pfl.stats.contribution_test`) in
place of the coin-based clipping test (pfl's coins are not Bernoulli); Laplace: the
Anderson scale and freshness tests (:func:`audit.libraries.pfl.stats.laplace_tests`) and the
contribution test. A claim of Poisson sampling adds the sampling tests
(:mod:`audit.bounds.sampling`: exchangeability of the canaries' draws, their rate). All are
corrected together by Holm. The claim check compares σ (``relative_noise_stddev``; Laplace:
the scale b/C = 1/ε of ``LaplaceMechanism``), C (``clipping_bound``), the rounds, the cohort,
the population and the sampling with the claim (a mismatch is a finding, exit 1) and
recomputes ε for what ran (Gaussian: :func:`audit.claims.check.check_claim`; Laplace:
dp-accounting's PLD). pfl's own accountant's ε is reported beside it, with its assumptions
set against the run (``accountant``).

**The real users' privacy is unchanged.** Their updates are 0 on the canary block, so
their norms, clip factors and clipped updates are those without canaries; the block only
adds coordinates to the noise. What changes is the population (N real users + the included
canaries): state it (:attr:`PflCanaries.population`) in pfl's accountant and the claim.

**Verdict.** ``pass`` only when clipping, noise and accounting were each tested (and the
sampling, unless every user took part in every round): the claim check (ε recomputed, the
sampler's draws read from pfl), the contribution test and the scale and freshness tests
(``coverage``, :func:`audit.coverage.decide`); otherwise ``incomplete`` (exit 4) naming
what was not, ``fail`` (exit 1) on a finding. A round whose noised sum holds NaN or Inf is
``release_nonfinite`` and a release without noise ``noise_absent`` (the implied ε ∞),
never an exception.

**Versions.** pfl 0.1.0 (2024-03, the first release) … 0.6.0 (:data:`SUPPORTED`;
:mod:`audit.libraries.pfl.compat` says what differs); a newer pfl is one warning line.

**Layout.** :mod:`~audit.libraries.pfl.compat` (what is imported from pfl),
:mod:`~audit.libraries.pfl.canaries` (the canary users, module, observer and callback),
:mod:`~audit.libraries.pfl.run` (what the run used, against the claim and pfl's accountant),
:mod:`~audit.libraries.pfl.stats` (the contribution and Laplace tests),
:mod:`~audit.libraries.pfl.epsilon` (the ε of what ran),
:mod:`~audit.libraries.pfl.canary_tests` (the observations tested, the coverage),
:mod:`~audit.libraries.pfl.checks` (:class:`PflAudit`, :func:`attach`). The former modules
``audit.libraries.pfl_audit``, ``pfl_canaries``, ``pfl_run`` and ``pfl_stats`` are kept as
aliases.
"""

# the extra, checked on import: without pfl this raises a one-line ImportError naming it
from audit.libraries.pfl.compat import PFL_VERSION, SUPPORTED
from fl.lazy import lazy_exports

#: public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "ALPHA": "audit.libraries.pfl.checks",
    "LB_ALPHA": "audit.libraries.pfl.checks",
    "CanaryCallback": "audit.libraries.pfl.canaries",
    "CanaryModule": "audit.libraries.pfl.canaries",
    "CanaryObserver": "audit.libraries.pfl.canaries",
    "PflAudit": "audit.libraries.pfl.checks",
    "PflCanaries": "audit.libraries.pfl.canaries",
    "accountant_claim": "audit.libraries.pfl.run",
    "attach": "audit.libraries.pfl.checks",
}

__all__ = ["PFL_VERSION", "SUPPORTED", *_EXPORTS]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
