"""Flower's DP paths audited end to end (#43): canary clients that take Flower's own path.

One call, :func:`audit_flower`, runs a Flower DP training in this process (no Ray, no
SuperLink) with M canary clients among the user's K clients and audits it against a claim
(:mod:`audit.libraries.flower.checks` holds the audit)::

    result = audit_flower(
        dp_strategy,                 # a Flower DP wrapper (legacy or Message API) around FedAvg
        client_fn=client_fn,         # legacy: client_fn(context) -> Client
        # or train=train,            # Message API: train(msg, context) -> Message
        mods=[...],                  # the ClientApp's mods (fixedclipping_mod, LocalDpMod, …)
        num_clients=10, initial_arrays=[w, b], rounds=20, claim={...},
    )
    result["verdict"], result["exit_code"], result["findings"]

**What travels.** The model's arrays get one more array, the *canary block* (M zeros,
key :data:`BLOCK_KEY`). The K real clients run the user's code behind a shim that hands them
the model without the block and puts the block back unchanged in their reply, so a real
client's update on the block is exactly 0 (and its update norm is the one without canaries).
The M canary clients are nodes of the same grid: Flower's own sampler (``configure_fit`` /
``configure_train``: ``random.sample`` of the cohort among every node) draws them like the
real ones. Canary j's inclusion bit (probability ``p_include``, drawn before the run) says
whether its reply carries ``gain·C·e_j`` on the block (gain 100, C the clip in force) or an
update of 0; either way it is a node, takes part when drawn and reports ``num_examples``
like a real client, so the pool, the cohort size and the weights do not depend on the bits.
The reply then takes Flower's path: the user's mods (client-side clipping, ``LocalDpMod``),
the wrapper's clipping (server side), the inner strategy's weighted average (FedAvg weighs
by the reported ``num_examples``), the wrapper's noise. The released global model's block is
read after every round (``after − before``), and, for ``LocalDpMod``, each canary reply as
the server receives it.

**What a canary reports.** ``canary_examples``: an int, or None (default) = the largest
``num_examples`` a real client has reported so far (canaries reply after the real clients of
their round), so an aggregation that weighs by size gives the canary the weight of the
largest client and an unequal weighting shows on the block (contribution m·w_j ≠ 1).

**In-process driving.** Message API: ``strategy.start(grid=...)`` over :class:`LocalGrid`,
a :class:`flwr.serverapp.Grid` that calls the ClientApps directly. Legacy API: the loop of
``flwr.server.Server.fit_round`` (``configure_fit``, each client's ``fit``, ``aggregate_fit``)
over the same grid through Flower's grid client proxies. Two Flower internals are needed and
wrapped in one place each (:mod:`audit.libraries.flower.compat`).

**Failures, as Flower handles them.** A ClientApp that raises gets the SuperNode's error
reply; a reply that times out is missing from what the grid returns; the legacy loop
collects both as ``fit_clients`` does (``failures``). Flower's DP wrappers then skip the
round (legacy: ``aggregate_fit`` returns None on any failure; Message API:
``validate_replies`` refuses error replies, and a short count too when an accountant is
set); a plain FedAvg (``LocalDpMod``) drops them and aggregates the rest. Without an
accountant the Message API wrapper aggregates FEWER replies than ``num_sampled_clients``
under the noise σ·C/m (it only logs a warning): each reply weighs 1/m' > 1/m, a finding of
its own (``fewer_replies_than_sampled``, ε recomputed at the smallest m'). A skipped round
releases nothing: fewer rounds than claimed is a warning (``fewer_rounds_than_claimed``).
``inject_failures`` (:class:`ClientFailure`: a real client raising, timing out, replying
NaN in a round) tries these paths. A release holding NaN or Inf (``release_nonfinite``) and
a release without noise (``noise_absent``) are findings with ε = ∞, never an exception.

**Verdict.** ``pass`` only when sampling, clipping, noise and accounting were each tested
(``coverage``, :func:`audit.coverage.decide`); otherwise ``incomplete`` (exit 4) naming
the untested parts (adaptive clipping: the clipped-count release's noise is not observed),
``fail`` (exit 1) on an error finding.

**Versions.** flwr 1.8 (2024-04) … 1.42: the legacy API in all of them, the Message API
from 1.21 (:mod:`audit.libraries.flower.compat` says what differs); an older flwr is one
``RuntimeError`` line naming it and the range (:data:`SUPPORTED`). ``LocalDpMod`` of
1.8 … 1.13 drops its noise: the audit says ``noise_absent``.

**Layout.** :mod:`~audit.libraries.flower.canaries` (the canary clients, the block, the
modes), :mod:`~audit.libraries.flower.compat` (what is read from flwr), :mod:`~audit.
libraries.flower.grid` (the in-process grid), :mod:`~audit.libraries.flower.clients` (the
ClientApps), :mod:`~audit.libraries.flower.run` (the run and :func:`audit_flower`),
:mod:`~audit.libraries.flower.checks` (the audit: :mod:`~audit.libraries.flower.central`,
:mod:`~audit.libraries.flower.local`, :mod:`~audit.libraries.flower.verdict`).
``audit.libraries.flower_audit`` is kept as an alias of the audit's public names.

flwr is imported only inside functions (this package imports on a machine without it).
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "BLOCK_KEY": "audit.libraries.flower.canaries",
    "MODES": "audit.libraries.flower.canaries",
    "ClientFailure": "audit.libraries.flower.canaries",
    "FlowerCanaries": "audit.libraries.flower.canaries",
    "FlowerRun": "audit.libraries.flower.run",
    "LocalGrid": "audit.libraries.flower.grid",
    "SUPPORTED": "audit.libraries.flower.compat",
    "audit_flower": "audit.libraries.flower.run",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
