"""The engine: the run directory's contract, equivalences (σ = 0, one client = centralized
training), budgets, client-level events, CLI input errors, methods under DP, evaluation.
Resume, kills and STOP: test_engine_resume.py."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fl.models import factors as F
from fl.models.base import LoraSpec, load_base_model, wrap_lora
from fl.privacy.accounting import epsilon
from fl.privacy.ledger import Ledger
from fl.run.engine import Engine, derive_seed, poisson_masks, train
from pipeline.cli import main as cli_main


def _adapter(run):
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_run_directory_contract(tmp_path, tiny_cfg):
    out = tmp_path / "run"
    m = train(tiny_cfg(dp_level="sample", noise_multiplier=1.0), out)
    for f in (
        "manifest.json",
        "metrics.jsonl",
        "splits.json",
        "ledger.json",
        "adapter/adapter_config.json",
    ):
        assert (out / f).is_file(), f
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert all(
        {"accuracy", "loss", "epsilon", "seconds", "init_noise", "agg_noise"} <= r.keys()
        for r in rows
    )
    assert rows[0]["epsilon"] < rows[1]["epsilon"]
    priv = m["privacy"]
    assert priv["level"] == "sample" and priv["noise_multiplier"] == 1.0
    led = Ledger.from_state_dict(priv["ledger"])
    assert led.epsilon("pld") == pytest.approx(priv["epsilon"]["pld"])
    # three clients, two rounds, all participate: 6 events of local_steps each
    assert len(led.events) == 6 and all(e.count == 4 for e in led.events)
    q = priv["sample_rates"]["0"]
    assert priv["epsilon"]["pld"] == pytest.approx(epsilon(1.0, q, 8, priv["delta"]), rel=1e-9)
    splits = json.loads((out / "splits.json").read_text())
    members = sorted(i for ids in splits["clients"].values() for i in ids)
    assert members == sorted(splits["members"])
    assert not set(splits["members"]) & set(splits["nonmembers"])
    # the adapter loads with peft on the same base model and reproduces the metrics
    from peft import PeftModel

    base = load_base_model("tiny-bert", 2, seed=0)
    model = PeftModel.from_pretrained(base, str(out / "adapter"))
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_sigma_zero_huge_clip_equals_non_dp(tmp_path, tiny_cfg):
    kw = dict(optimizer="sgd", lr=0.05, rounds=2)
    train(tiny_cfg(**kw), tmp_path / "plain")
    # A run without DP draws its batches from the public seed; the seeded mode of the
    # DP run draws the same ones (the noise stream draws nothing at σ = 0).
    cfg = tiny_cfg(
        dp_level="sample", noise_multiplier=0.0, clip=1e9, insecure_deterministic_noise=True, **kw
    )
    train(cfg, tmp_path / "dp")
    assert _max_diff(_adapter(tmp_path / "plain"), _adapter(tmp_path / "dp")) < 1e-5
    m = json.loads((tmp_path / "dp" / "manifest.json").read_text())
    assert m["privacy"]["epsilon"]["pld"] == "inf"  # σ = 0 never reports a finite ε


def test_fedavg_one_client_equals_centralized_training(tmp_path, tiny_cfg):
    """One client, full participation: the federated pipeline (state copies, weighted
    average with weight 1, reloading every round) must equal a plain training loop."""
    # The reference loop runs each batch in one pass (dropout on): so does the engine
    # here; length buckets are compared to one pass in tests/fl/test_length_buckets.py.
    cfg = tiny_cfg(
        clients=1,
        rounds=3,
        local_steps=3,
        optimizer="sgd",
        lr=0.05,
        lora_dropout=0.0,
        length_buckets=False,
    )
    eng = Engine(cfg, tmp_path / "fed", quiet=True)
    eng.run()
    fed = _adapter(tmp_path / "fed")

    data = eng.members_data
    model = wrap_lora(
        load_base_model("tiny-bert", 2, seed=cfg.seed, head_init=cfg.head_init),
        LoraSpec(cfg.rank, cfg.alpha),
        seed=cfg.seed,
    )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=cfg.lr)
    n = len(data)
    q = cfg.batch_size / n
    for r in range(cfg.rounds):
        parts = (cfg.seed, "round", r, "client", "0", "train")
        torch.manual_seed(derive_seed(*parts, "dropout"))
        batches = eng.rand.stream("poisson-batches", r, "0", "train")
        for mask in poisson_masks(batches, n, q, cfg.local_steps):
            idx = torch.arange(n)[mask]
            opt.zero_grad()
            b = data.batch(idx, "cpu")
            y = b.pop("labels")
            loss = torch.nn.functional.cross_entropy(model(**b).logits, y, reduction="sum") / (
                q * n
            )
            loss.backward()
            opt.step()
    ref = F.get_state(model)
    got = F.unflatten_state(
        {
            (
                "factors/"
                + k.replace("base_model.model.", "")
                .replace(".lora_A.weight", "/A")
                .replace(".lora_B.weight", "/B")
            )
            if "lora_" in k
            else "head/"
            + k.replace("base_model.model.", "")
            .replace(".modules_to_save.default", "")
            .replace("classifier.", "classifier."): v
            for k, v in fed.items()
        }
    )
    for k in ref["factors"]:
        for w in ("A", "B"):
            assert torch.allclose(ref["factors"][k][w], got["factors"][k][w], atol=1e-6), (k, w)


def test_budget_is_enforced_with_calibrated_sigma(tmp_path, tiny_cfg):
    # ε = 2, not 4: σ ≈ 1.4 rather than 0.95, whose PLD (calibrated, checked each round)
    # is smaller; the target's value is not what is tested
    m = train(
        tiny_cfg(dp_level="sample", epsilon=2.0, rounds=2, clients_per_round=2), tmp_path / "r"
    )
    assert m["privacy"]["target_epsilon"] == 2.0
    assert m["privacy"]["epsilon"]["pld"] <= 2.0
    assert m["privacy"]["noise_multiplier"] > 0


def test_client_level_dp_fedavg_records_one_event_per_round(tmp_path, tiny_cfg):
    m = train(
        tiny_cfg(
            dp_level="client", noise_multiplier=1.0, clients=10, members=400, min_client_size=4
        ),
        tmp_path / "c",
    )
    evs = m["privacy"]["ledger"]["events"]
    assert len(evs) == 2 and all(e["unit"] == "federation" and e["kind"] == "gaussian" for e in evs)
    assert m["privacy"]["epsilon"]["pld"] == pytest.approx(
        epsilon(1.0, 1.0, 2, m["privacy"]["delta"]), rel=1e-9
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--method", "nope"], "unknown method"),
        (["--dp-level", "sample", "--epsilon", "-1"], "epsilon"),
        (["--dp-level", "sample", "--noise-multiplier", "-0.5"], "σ"),
        (["--dp-level", "sample", "--noise-multiplier", "1", "--delta", "0.5"], "delta"),
        (["--dp-level", "sample", "--noise-multiplier", "1", "--delta", "1.5"], "delta"),
        (["--clip", "0"], "clipping bound"),
        (["--rank", "0"], "rank"),
        (["--model", "/nonexistent/model"], "unknown model"),
        (["--dataset", "nope"], "unknown dataset"),
        (["--config", "/nonexistent.toml"], "config file not found"),
        (["--dp-level", "none", "--epsilon", "8"], "--dp-level none"),
        (["--opt", "mu=0.1"], "unknown option"),
        # the probe trains only the head: an --lr it would not use is refused
        (["--method", "probe", "--lr", "0.05"], "--head-lr 0.03; --lr 0.05 would be unused"),
        (["--method", "probe", "--lr", "0.05", "--head-lr", "0.01"], "--lr 0.05 would be"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, needle):
    base = [
        "train",
        "--model",
        "tiny-bert",
        "--dataset",
        "synthetic",
        "--members",
        "240",
        "--test",
        "50",
        "--nonmembers",
        "10",
        "--clients",
        "3",
        "--rounds",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path / "o"),
    ]
    rc = cli_main(base + args)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "o" / "manifest.json").exists()


@pytest.mark.parametrize(
    "args,head",
    [
        (["--lr", "0.05", "--head-lr", "0"], 0.05),  # head_lr 0: the head takes --lr
        (["--head-lr", "0.05"], 0.05),
        (["--lr", "0.05", "--head-lr", "0.05"], 0.05),
        ([], 0.03),  # neither given: the head's default rate
        (["--config", str(Path(__file__).parents[2] / "configs/minilm-tweets-probe.toml")], 0.05),
    ],
)
def test_probe_learning_rate_forms_that_say_what_they_do(args, head):
    from fl.cli.train import config_from_args
    from pipeline.cli import build_parser

    cfg = config_from_args(build_parser().parse_args(["train", "--method", "probe", *args]))
    assert (cfg.head_lr or cfg.lr) == pytest.approx(head)


def test_existing_output_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    rc = cli_main(
        [
            "train",
            "--model",
            "tiny-bert",
            "--dataset",
            "synthetic",
            "--members",
            "240",
            "--test",
            "50",
            "--rounds",
            "1",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert rc == 2 and "not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious"


def test_toml_config_and_opts(tmp_path):
    cfgf = tmp_path / "c.toml"
    cfgf.write_text(
        'method = "fedprox"\nmodel = "tiny-bert"\ndataset = "synthetic"\nmembers = 240\ntest = 50\n'
        "nonmembers = 10\nclients = 3\nrounds = 1\nlocal_steps = 2\nprogress = false\n[opts]\nmu = 0.5\n"
    )
    rc = cli_main(["train", "--config", str(cfgf), "--rounds", "1", "--out", str(tmp_path / "o")])
    assert rc == 0
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["method"] == "fedprox" and m["method_options"] == {"mu": 0.5}


@pytest.mark.parametrize("method", ["ffa", "fedsa", "fedprox", "scaffold"])
def test_homogeneous_methods_run_with_dp(tmp_path, tiny_cfg, method):
    m = train(
        tiny_cfg(method=method, dp_level="sample", noise_multiplier=1.0, rounds=2),
        tmp_path / method,
    )
    # every client trains every round: its ε composes local_steps × rounds subsampled
    # Gaussians at q_k = B / n_k; the run's ε is the worst client's
    priv, cfg = m["privacy"], m["config"]
    want = max(
        epsilon(1.0, min(1.0, cfg["batch_size"] / n), cfg["local_steps"] * 2, priv["delta"])
        for n in priv["client_sizes"].values()
    )
    assert priv["epsilon"]["pld"] == pytest.approx(want, rel=1e-9)
    assert 0.0 <= m["metrics"]["final"]["accuracy"] <= 1.0
    if method == "ffa":  # A frozen at its init: identical to the initial A
        eng = Engine(tiny_cfg(method="ffa"), tmp_path / "x", quiet=True)
        eng.setup()
        init = eng.trainer.initial_state()
        ad = _adapter(tmp_path / method)
        for k, v in ad.items():
            if "lora_A" in k:
                mod = k.replace("base_model.model.", "").replace(".lora_A.weight", "")
                assert torch.equal(v, init["factors"][mod]["A"])


def test_evaluate_in_length_order_equals_one_example_at_a_time(tmp_path, tiny_cfg):
    """Evaluation batches examples by length; accuracy, balanced accuracy and loss equal
    a per-example reference (no padding at all) on a random (B != 0) state."""
    eng = Engine(tiny_cfg(test=37), tmp_path / "e", quiet=True)
    eng.setup()
    g = torch.Generator().manual_seed(5)
    state = F.clone_state(eng.trainer.initial_state())
    for fac in state["factors"].values():
        fac["B"] = torch.randn(fac["B"].shape, generator=g) * 0.5
    data = eng.test_data
    assert len(set(data.lengths.tolist())) > 3  # lengths really vary
    ev = eng.trainer.evaluate(state, data, batch_size=5)
    F.set_state(eng.trainer.model, state)
    eng.trainer.model.eval()
    preds, losses = [], []
    with torch.no_grad():
        for i in range(len(data)):
            b = data.batch(torch.tensor([i]), eng.device)
            y = b.pop("labels")
            logits = eng.trainer.model(**b).logits.float()
            losses.append(float(torch.nn.functional.cross_entropy(logits, y)))
            preds.append(int(logits.argmax(-1)))
    eng.trainer.model.train()
    preds = torch.tensor(preds)
    acc = float((preds == data.labels).float().mean())
    recalls = [float((preds[data.labels == c] == c).float().mean()) for c in data.labels.unique()]
    assert ev["accuracy"] == pytest.approx(acc, abs=1e-6)
    assert ev["balanced_accuracy"] == pytest.approx(sum(recalls) / len(recalls), abs=1e-6)
    assert ev["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4)


def test_lora_targets_by_dotted_suffix_pick_one_layer():
    """A target may name one layer's module ("layer.1.attention.self.query", peft's
    suffix rule); a plain name still names every layer's; an unknown one is refused."""
    from fl.errors import UsageError

    def wrapped(targets):
        net = load_base_model("tiny-bert", 2, seed=0)
        model = wrap_lora(net, LoraSpec(4, 8.0, target_modules=targets), seed=0)
        return sorted(n.split(".lora_A")[0] for n, _ in model.named_parameters() if "lora_A" in n)

    one = wrapped(("layer.1.attention.self.query", "layer.1.attention.self.value"))
    assert [n.rsplit("encoder.", 1)[1] for n in one] == [
        "layer.1.attention.self.query",
        "layer.1.attention.self.value",
    ]
    assert len(wrapped(("query", "value"))) == 4  # 2 layers x 2 modules
    with pytest.raises(UsageError, match="layer.7.attention.self.query"):
        wrapped(("layer.7.attention.self.query",))
