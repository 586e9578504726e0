"""What a method sees of the engine: :class:`ClientContext` (a client handler's view:
its id, data, persistent state and ``train``), :class:`ServerContext` (the server
program's view), and :class:`InProcessTransport`, which hands a ClientContext to the
method's handlers in this process. Methods may use only the members of the protocols
they implement, :class:`fl.methods.context.ClientView` and ``ServerView``.

The contexts hold the :class:`fl.run.engine.Engine` they were built from but do not import
it: the engine imports this module (no cycle; see pyproject's contracts).
"""

from __future__ import annotations

import torch

from fl.errors import ClientFailure, UsageError
from fl.methods.rounds import RoundInfo
from fl.privacy import rng as R
from fl.privacy import tap
from fl.privacy.accounting import Event
from fl.privacy.canary_clients import CanaryClients, check_supported
from fl.privacy.dpsgd import DpSgdParams, server_noise_fault
from fl.privacy.rng import derive_seed
from fl.run.config import TrainConfig
from fl.run.local_step import local_step
from fl.run.trainer import TrainResult
from fl.run.transport import Delivery


class ClientContext:
    """What a client handler sees: its id, data size, persistent state, and ``train``
    (``ClientView``; ``engine``, ``positions``, ``events`` and ``steps`` are the
    transports' side)."""

    def __init__(self, engine, cid: str, rnd: RoundInfo):  # engine: fl.run.engine.Engine
        self.engine = engine
        self.id = cid
        self.round = rnd
        self.positions = engine.client_positions[cid]
        # the public size (before secret canaries): aggregation weights and sampling
        # rates must not depend on how many canaries a client received
        self.n = engine.public_size(cid)
        self.state: dict = engine.client_states.setdefault(cid, {})
        self.events: list[Event] = []

    @property
    def scaling(self) -> float:
        return self.engine.trainer.scaling

    @property
    def rank(self) -> int:
        """This client's LoRA rank r_i (``--client-ranks`` / ``--client-ranks-list``; R
        when not given)."""
        eng = self.engine
        return int(eng.client_ranks.get(self.id, eng.cfg.rank))

    @property
    def lr(self) -> float:
        """The local learning rate of the LoRA factors."""
        return self.engine.cfg.lr

    def lr_of(self, key: str) -> float:
        """The learning rate of a flat state key (SCAFFOLD's control-variate update
        needs it): the head's for ``head/...``, else the factors'."""
        return self.engine.trainer.lr_of(key)

    @property
    def model(self):
        """The one shared peft model the client trains in (a base-weight overlay such as
        FLoRA's merge, or FedASK's W-space clipper, hooks into it)."""
        return self.engine.trainer.model

    def steps(self) -> int:
        return self.engine.local_steps_for(self.engine.public_size(self.id))

    def dp_params(self) -> DpSgdParams | None:
        return self.engine.dp_params_for(self.engine.public_size(self.id))

    def train(
        self,
        start: dict,
        trainable: set[str] | tuple[str, ...] = ("A", "B", "head"),
        prox_mu: float = 0.0,
        correction: dict[str, torch.Tensor] | None = None,
        grad_transform=None,
        grad_mask: dict[str, torch.Tensor] | None = None,
        stage: str = "train",
    ) -> TrainResult:
        eng = self.engine
        dp = self.dp_params()
        steps = self.steps()
        r = self.round.index
        if stage == "train" and eng.cfg.head_only(r):  # linear probing first
            trainable = set(trainable) & {"head"}
            if not trainable or grad_transform is not None:
                raise UsageError(
                    f"head_warmup_rounds: round {r} trains the head alone, which this "
                    "method's local training cannot do"
                )
        opt_state = None if eng.cfg.reset_optimizer else self.state.get("_opt")
        if r == eng.cfg.head_warmup_rounds and eng.cfg.head_warmup_rounds:
            opt_state = None  # the factors join the head: a fresh optimizer
        cid = self.id
        privatizer, hooks = local_step(
            dp,
            eng.rand.round_stream("dpsgd-noise", r, cid, stage),
            prox_mu=prox_mu,
            correction=correction,
            grad_transform=grad_transform,
            grad_mask=grad_mask,
        )
        with tap.scope(client=cid, stage=stage):  # labels this training's releases
            result, opt_sd = self._run_trainer(
                start, steps, trainable, privatizer, hooks, stage, opt_state
            )
        if not eng.cfg.reset_optimizer:
            self.state["_opt"] = opt_sd
        if dp is not None:
            self.events.append(
                Event(
                    "poisson_gaussian" if dp.sample_rate < 1 else "gaussian",
                    dp.noise_multiplier,
                    dp.sample_rate,
                    steps,
                    unit=f"client:{self.id}",
                    round=self.round.index,
                    stage=stage,
                    note="DP-SGD local steps",
                )
            )
        return result

    def _run_trainer(self, start, steps, trainable, privatizer, hooks, stage, opt_state):
        eng, cid, r = self.engine, self.id, self.round.index
        return eng.trainer.run(
            start,
            eng.members_data,
            self.positions,
            steps,
            set(trainable),
            privatizer,
            hooks,
            eng.rand.round_stream("poisson-batches", r, cid, stage),
            dropout_seed=derive_seed(eng.cfg.seed, "round", r, "client", cid, stage, "dropout"),
            opt_state=opt_state,
            lr_scale=eng.cfg.lr_scale(r),
            sample_size=self.n,
        )


class InProcessTransport:
    """Direct calls to the method's handlers (the engine's :class:`Dispatcher` does
    byte counts, validation, failures and ledger events)."""

    name = "inprocess"

    def __init__(self, engine):  # engine: fl.run.engine.Engine
        self.engine = engine

    def deliver(self, method, rnd: RoundInfo, stage, payloads, faults) -> dict[str, Delivery]:
        eng = self.engine
        handler = getattr(method, f"on_{stage}")
        out: dict[str, Delivery] = {}
        for cid, p in eng.progress(payloads, desc=f"round {rnd.index + 1} {stage}", leave=False):

            def run(cid=cid, p=p) -> Delivery:
                saved = dict(eng.client_states.get(cid, {}))
                ctx = ClientContext(eng, cid, rnd)
                try:
                    if faults.get(cid):
                        raise ClientFailure(faults[cid])
                    reply = dict(handler(ctx, p))
                except ClientFailure as exc:
                    # The client's state is rolled back (what it trained is not kept); the
                    # DP steps it took still count: its data was touched.
                    eng.client_states[cid] = saved
                    return Delivery(None, list(ctx.events), f"{type(exc).__name__}: {exc}")
                reply.setdefault("n", ctx.n)
                return Delivery(reply, list(ctx.events))

            out[cid] = tap.deliver(cid, stage, run)  # a replay may hand back a recorded one
        return out


class ServerContext:
    """What a method's server program sees of the engine (``ServerView``)."""

    def __init__(self, engine):  # engine: fl.run.engine.Engine
        self.e = engine
        self._canary_clients: CanaryClients | None = None
        if engine.cfg.canary_clients > 0:  # refused at set-up where it cannot be placed
            check_supported(
                engine.cfg.method,
                engine.cfg.dp_level,
                engine.client_scheme()[0],
                engine.cfg.canary_clients,
            )

    @property
    def canary_clients(self) -> CanaryClients | None:
        """The run's canary clients (``--canary-clients``; None without), built on first
        use: their set is drawn from the secret key after the noise is calibrated."""
        e = self.e
        if e.cfg.canary_clients <= 0:
            return None
        if self._canary_clients is None:
            scheme, m, K = e.client_scheme()
            self._canary_clients = CanaryClients(
                e.cfg.canary_clients,
                e.cfg.clip,
                e.rand,
                e.out,
                method=e.cfg.method,
                scheme=scheme,
                rate=m / K if scheme == "poisson" else 1.0,
                rounds=e.cfg.rounds,
                sigma=e.sigma,
                delta=e.delta,
            )
        return self._canary_clients

    @property
    def cfg(self) -> TrainConfig:
        return self.e.cfg

    @property
    def scaling(self) -> float:
        return self.e.trainer.scaling

    @property
    def dp_level(self) -> str:
        return self.e.cfg.dp_level

    @property
    def noise_multiplier(self) -> float:
        return self.e.sigma

    @property
    def clip(self) -> float:
        return self.e.cfg.clip

    @property
    def expected_clients_per_round(self) -> float:
        return self.e.expected_clients_per_round()

    def noise_generator(self, rnd: RoundInfo, purpose: str) -> R.NoiseSource:
        """The run's secret noise stream for this round's server-side release."""
        return self.e.rand.round_stream("server", rnd.index, purpose)

    def noise(self, shape, std, gen) -> torch.Tensor:
        noise = R.draw_normal(gen, shape, std)
        return server_noise_fault(noise, self.e.cfg) if self.e.cfg.inject_fault else noise

    def record_client_level_release(self, rnd: RoundInfo, stage: str, count: int = 1, sigma=None):
        self.e.record_client_level(rnd, stage, count, sigma)

    def log(self, msg: str) -> None:
        self.e.log(msg)

    def client_rank(self, cid: str) -> int:
        return self.e.client_ranks.get(cid, self.e.cfg.rank)

    @property
    def model(self):
        """The one shared peft model :meth:`evaluate` runs (for a base-weight overlay)."""
        return self.e.trainer.model

    def is_eval_round(self, rnd: RoundInfo) -> bool:
        """The engine's evaluation rounds: every ``eval_every``-th and the last."""
        cfg = self.e.cfg
        return (rnd.index + 1) % cfg.eval_every == 0 or rnd.index + 1 == cfg.rounds

    def evaluate(self, state: dict) -> dict:
        """Accuracy and loss of ``state`` on the test data (as the engine evaluates)."""
        e = self.e
        return e.trainer.evaluate(state, e.test_data, e.cfg.eval_batch_size)
