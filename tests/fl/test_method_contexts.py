"""Methods see the engine only through the protocols of fl/methods/context.py.

Two checks, each able to fail on a method that reaches past them (shown by the
negative tests at the end):

- static: every file in fl/methods is parsed; each attribute read on a client context
  (a parameter annotated ``ClientView``), on the server context (``self.server``, a
  parameter annotated ``ServerView``, or a local alias of either) and on its ``cfg``
  must be a member of the matching protocol; ``getattr``/``vars`` on a context, and
  storing a context anywhere but a local name, are refused; every ``on_<stage>``
  handler annotates its client ``ClientView``.
- dynamic: every registered method runs two rounds, at each DP level it supports,
  against fakes that implement the protocols' members and nothing else (``__slots__``;
  anything more is an AttributeError), then checkpoints and restores.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from fl.methods import registry
from fl.methods.base import parse_options
from fl.methods.context import ClientView, RunSettings, ServerView, TrainOutcome
from fl.methods.rounds import Replies, RoundInfo
from fl.models import factors as F
from fl.privacy import rng as R
from fl.privacy.dpsgd import DpSgdParams
from fl.run.config import TrainConfig
from fl.run.contexts import ClientContext, ServerContext
from fl.run.trainer import TrainResult

METHODS_DIR = Path(__file__).resolve().parents[2] / "fl" / "methods"
VIEWS = {"ClientView": ClientView, "ServerView": ServerView, "RunSettings": RunSettings}


def members(proto: type) -> set[str]:
    """The public names a protocol declares (attributes, properties, methods)."""
    names = set(getattr(proto, "__annotations__", {}))
    names |= {k for k in vars(proto) if not k.startswith("_")}
    return {n for n in names if not n.startswith("_")}


# ------------------------------------------------------------------------ static


def _view_of(annotation: ast.expr | None) -> str | None:
    if isinstance(annotation, ast.Name) and annotation.id in VIEWS:
        return annotation.id
    if isinstance(annotation, ast.Attribute) and annotation.attr in VIEWS:
        return annotation.attr
    if isinstance(annotation, ast.Constant) and annotation.value in VIEWS:
        return annotation.value
    return None


class _FunctionCheck(ast.NodeVisitor):
    """Attribute reads on the contexts inside one function (nested functions see the
    enclosing function's context names)."""

    def __init__(self, where: str, ctx: dict[str, str], errors: list[str]):
        self.where, self.ctx, self.errors = where, dict(ctx), errors

    def kind(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.ctx.get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return "ServerView" if node.attr == "server" else None
            if node.attr == "cfg" and self.kind(node.value) == "ServerView":
                return "RunSettings"
        return None

    def fail(self, node: ast.AST, msg: str) -> None:
        self.errors.append(f"{self.where}:{node.lineno}: {msg}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        kind = self.kind(node.value)
        if kind is not None and node.attr not in members(VIEWS[kind]):
            self.fail(node, f"{ast.unparse(node)} is not part of {kind}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id in ("getattr", "setattr", "hasattr", "vars", "dir"):
            if node.args and self.kind(node.args[0]) is not None:
                self.fail(node, f"dynamic access {ast.unparse(node)} on a context")
        self.generic_visit(node)

    def _targets(self, targets: list[ast.expr], value: ast.expr) -> None:
        pairs: list[tuple[ast.expr, ast.expr]] = []
        for t in targets:
            if isinstance(t, ast.Tuple) and isinstance(value, ast.Tuple):
                pairs += list(zip(t.elts, value.elts))
            else:
                pairs.append((t, value))
        for t, v in pairs:
            kind = self.kind(v)
            if kind is None:
                if isinstance(t, ast.Name):
                    self.ctx.pop(t.id, None)
                continue
            if isinstance(t, ast.Name):
                self.ctx[t.id] = kind  # a local alias: checked like the context itself
            elif not (self.where.endswith("Method.__init__") and ast.unparse(t) == "self.server"):
                self.fail(t, f"a context stored in {ast.unparse(t)} (only local names)")

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        self._targets(node.targets, node.value)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        _check_function(node, f"{self.where}.{node.name}", self.ctx, self.errors)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.generic_visit(node)


def _check_function(fn, where: str, outer: dict[str, str], errors: list[str]) -> None:
    ctx = dict(outer)
    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    for a in args:
        view = _view_of(a.annotation)
        if view:
            ctx[a.arg] = view
        else:
            ctx.pop(a.arg, None)
            if a.arg in ("client", "server", "srv", "ctx"):
                errors.append(f"{where}:{fn.lineno}: parameter {a.arg!r} lacks its view type")
    if (
        fn.name.startswith("on_")
        and len(args) >= 2
        and _view_of(args[1].annotation) != "ClientView"
    ):
        errors.append(f"{where}:{fn.lineno}: handler {fn.name} must take `client: ClientView`")
    checker = _FunctionCheck(where, ctx, errors)
    for stmt in fn.body:
        checker.visit(stmt)


def context_violations(source: str, filename: str = "<method>") -> list[str]:
    """Every place in ``source`` where method code reaches past the context protocols."""
    errors: list[str] = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    _check_function(item, f"{filename}:{node.name}.{item.name}", {}, errors)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            _check_function(node, f"{filename}:{node.name}", {}, errors)
    return errors


def test_method_sources_use_only_the_protocols():
    files = sorted(p for p in METHODS_DIR.glob("*.py") if p.name != "context.py")
    assert len(files) >= 12
    errors = [e for p in files for e in context_violations(p.read_text(), p.name)]
    assert errors == []


def test_every_handler_and_server_hook_is_typed():
    for name in registry.names():
        cls = registry.get(name)
        handlers = [m for m in dir(cls) if m.startswith("on_")]
        assert handlers, name
        for h in handlers:
            ann = inspect.signature(getattr(cls, h)).parameters["client"].annotation
            assert ann in ("ClientView", ClientView), (name, h, ann)
        ann = inspect.signature(cls.__init__).parameters["server"].annotation
        assert ann in ("ServerView", ServerView), (name, ann)


def _instance_attrs(cls: type) -> set[str]:
    tree = ast.parse(inspect.getsource(cls.__init__).strip())
    targets = [t for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets]
    targets += [n.target for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)]
    return {
        t.attr
        for t in targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


@pytest.mark.parametrize(
    "impl, proto",
    [(ClientContext, ClientView), (ServerContext, ServerView)],
)
def test_engine_contexts_implement_the_protocols(impl, proto):
    have = set(dir(impl)) | _instance_attrs(impl)
    assert members(proto) <= have, members(proto) - have


def test_config_and_trainer_result_have_the_protocol_fields():
    assert members(RunSettings) <= {f for f in TrainConfig.__dataclass_fields__}
    assert members(TrainOutcome) <= {f for f in TrainResult.__dataclass_fields__}


# ----------------------------------------------------------------------- dynamic

RANK, CLIENTS = 4, ("0", "1", "2")
CLIENT_RANKS = {"0": 4, "1": 2, "2": 3}


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = torch.nn.Linear(6, 5)
        self.l1 = torch.nn.Linear(5, 7)


@pytest.fixture(scope="module")
def lora_model():
    """A tiny peft model whose LoRA layers are the fake state's modules (FLoRA's merged
    base and FedASK's W-space clipper hook into them)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(_Net(), LoraConfig(r=RANK, lora_alpha=8, target_modules=["l0", "l1"]))


def _initial(model) -> dict:
    st = F.get_state(model)
    g = torch.Generator().manual_seed(1)
    for ab in st["factors"].values():
        ab["B"] = 0.1 * torch.randn(ab["B"].shape, generator=g)
    st["head"] = {"w": torch.randn(2, 3, generator=g)}
    return st


class StrictSettings:
    __slots__ = ("rank", "seed", "clients", "head_clip_share")

    def __init__(self):
        self.rank, self.seed, self.clients = RANK, 0, len(CLIENTS)
        self.head_clip_share = 0.0


class StrictClient:
    """ClientView and nothing else (internals behind underscores, refused statically)."""

    __slots__ = ("id", "n", "round", "state", "_model", "_dp")

    def __init__(self, cid, rnd, state, model, dp_level):
        self.id, self.n, self.round, self.state = cid, 10 + int(cid), rnd, state
        self._model, self._dp = model, dp_level == "sample"

    @property
    def rank(self):
        return CLIENT_RANKS[self.id]

    @property
    def lr(self):
        return 0.05

    def lr_of(self, key):
        return 0.1 if key.startswith("head/") else 0.05

    @property
    def scaling(self):
        return 2.0

    @property
    def model(self):
        return self._model

    def dp_params(self):
        return DpSgdParams(1.0, 0.5, 0.5, 5.0) if self._dp else None

    def train(
        self,
        start,
        trainable=("A", "B", "head"),
        prox_mu=0.0,
        correction=None,
        grad_transform=None,
        grad_mask=None,
        stage="train",
    ):
        """start + a small seeded step on the trainable, unmasked coordinates."""
        g = torch.Generator().manual_seed(1000 * self.round.index + int(self.id))
        flat = {k: v.clone() for k, v in F.flatten_state(start).items()}
        for k, v in flat.items():
            part = "head" if k.startswith("head/") else k.rsplit("/", 1)[-1]
            if part in trainable:
                step = 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype)
                flat[k] = v + step * (grad_mask or {}).get(k, 1.0)
        return TrainResult(F.unflatten_state(flat), 0.5, 3, 3 * self.n)


class StrictServer:
    """ServerView and nothing else."""

    __slots__ = ("cfg", "dp_level", "_model", "_released", "_logs")

    def __init__(self, dp_level, model):
        self.cfg, self.dp_level, self._model = StrictSettings(), dp_level, model
        self._released, self._logs = [], []

    scaling = property(lambda self: 2.0)
    noise_multiplier = property(lambda self: 1.0)
    clip = property(lambda self: 1.0)
    expected_clients_per_round = property(lambda self: float(len(CLIENTS)))
    model = property(lambda self: self._model)
    canary_clients = property(lambda self: None)

    def client_rank(self, cid):
        return CLIENT_RANKS[cid]

    def is_eval_round(self, rnd):
        return True

    def evaluate(self, state):
        return {"accuracy": 0.5, "loss": 1.0}

    def noise_generator(self, rnd, purpose):
        return torch.Generator().manual_seed(rnd.seed + len(purpose))

    def noise(self, shape, std, gen):
        return R.draw_normal(gen, shape, std)

    def record_client_level_release(self, rnd, stage, count=1, sigma=None):
        self._released.append((rnd.index, stage, count, sigma))

    def log(self, msg):
        self._logs.append(msg)


@pytest.mark.parametrize(
    "fake, proto",
    [(StrictClient, ClientView), (StrictServer, ServerView), (StrictSettings, RunSettings)],
)
def test_fakes_implement_exactly_the_protocols(fake, proto):
    public = {n for n in dir(fake) if not n.startswith("_")}
    assert public == members(proto)


def run_method(cls, dp_level: str, model) -> dict:
    """Two rounds of ``cls`` against the strict fakes; returns the last round's metrics."""
    server = StrictServer(dp_level, model)
    meth = cls(server, parse_options(cls.Options, {}))
    meth.init_state(_initial(model))
    states: dict[str, dict] = {}

    def send(clients, stage, payload, per_client=False):
        out = Replies()
        for cid in clients:
            ctx = StrictClient(cid, rnd, states.setdefault(cid, {}), model, dp_level)
            reply = dict(getattr(meth, f"on_{stage}")(ctx, payload[cid] if per_client else payload))
            reply.setdefault("n", ctx.n)
            out.ok[cid] = reply
        return out

    metrics: dict = {}
    for r in range(2):
        rnd = RoundInfo(r, 100 + r, list(CLIENTS))
        metrics = meth.server_round(rnd, list(CLIENTS), send)
    meth.released_state()
    meth.eval_states()
    meth.privacy_note()
    meth.client_dp_releases()
    tensors, meta = meth.state_dict()
    again = cls(StrictServer(dp_level, model), parse_options(cls.Options, {}))
    again.init_state(_initial(model))
    again.load_state_dict(tensors, meta)
    return metrics


@pytest.mark.parametrize("name", registry.names())
def test_every_method_runs_on_the_protocols_alone(name, lora_model):
    cls = registry.get(name)
    for level in cls.dp_levels:
        metrics = run_method(cls, level, lora_model)
        assert "skipped" not in metrics and "failed_clients" not in metrics, (name, level)


# ------------------------------------------------------------ the checks can fail

BAD_SOURCE = """
class Leaky(Method):
    def server_round(self, rnd, clients, send):
        srv = self.server
        trainer = srv.e.trainer
        return {"R": self.server.cfg.eval_batch_size}

    def on_train(self, client: ClientView, payload: dict) -> dict:
        lr = client.engine.cfg.lr
        self.last = client
        return {"x": getattr(client, "positions")}

    def on_other(self, client, payload):
        return {}
"""


def test_static_check_flags_reaching_past_the_protocols():
    errors = "\n".join(context_violations(BAD_SOURCE, "leaky.py"))
    for what in ("srv.e ", "self.server.cfg.eval_batch_size", "client.engine ",
                 "self.last", "getattr(client, 'positions')", "handler on_other",
                 "parameter 'client' lacks"):  # fmt: skip
        assert what in errors + " ", (what, errors)


def test_dynamic_check_flags_reaching_past_the_protocols(lora_model):
    fedavg = registry.get("fedavg")

    class Leaky(fedavg):
        def on_train(self, client: ClientView, payload: dict) -> dict:
            client.engine  # noqa: B018 - what a leaking method would do
            return super().on_train(client, payload)

    with pytest.raises(AttributeError, match="engine"):
        run_method(Leaky, "none", lora_model)

    class LeakyServer(fedavg):
        def server_round(self, rnd, clients, send):
            self.server.cfg.eval_every  # noqa: B018
            return super().server_round(rnd, clients, send)

    with pytest.raises(AttributeError, match="eval_every"):
        run_method(LeakyServer, "none", lora_model)
