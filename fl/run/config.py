# Over 500 lines on purpose: one concept, the TrainConfig dataclass whose every field carries its
# help, choices and checks (like PEFT's LoraConfig); the CLI-only parsing is in fl/cli/train.py.
"""Training configuration: one dataclass, validated, each field with its help text.

The CLI (``fedlora train``) is generated from these fields; TOML config files use the
same names. There is no second source of defaults, valid choices (metadata ``choices``,
checked by :meth:`TrainConfig.validate`, passed to argparse) or of the fields that do not
change results (metadata ``runtime``: :data:`RUNTIME_FIELDS`, :func:`runtime_fields`,
:func:`result_fields`, used by ``--resume``, the checkpoint, the Flower ClientApp and the
run audit).
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from fl.errors import UsageError


def _f(default, help: str, **kw):
    """A config field. Metadata keys besides ``help``:

    - ``choices``: the valid values (a tuple), or a zero-argument callable returning
      them (for choices known only at run time, e.g. the registered methods).
      ``validate()`` checks every field that has them, the CLI passes them to argparse.
    - ``examples``: typical values shown in the help, not enforced (a field that also
      accepts a path).
    - ``runtime``: the field does not change the run's results. ``"run"``: it may differ
      between a run and its resume, replay or audit (:data:`RUNTIME_FIELDS`). ``"client"``:
      it does not change what a client computes (the Flower ClientApp's configuration
      fingerprint ignores it; :func:`runtime_fields` with ``scope="client"``).
    - ``cli``: ``False`` keeps the field off the command line.
    """
    return field(default=default, metadata={"help": help, **kw})


#: ``--inject-fault`` (tests only, auditing the auditor): name → (DP level it applies to,
#: what its value must be: None = no value, "float" = a factor >= 0 other than 1, or the
#: tuple of allowed values)
FAULTS: dict[str, tuple[str, object]] = {
    "noise_scale": ("any", "float"),
    "no_clip": ("sample", None),
    "head_unnoised": ("sample", None),
    "factor_unnoised": ("sample", ("A", "B")),
    "noise_reuse": ("sample", None),
    "fixed_batches": ("sample", None),
    "server_noise_omitted": ("client", None),
    "fedask_stage1_unnoised": ("sample", None),
}
FAULT_SERVER = "server_noise_omitted"


def parse_fault(spec: str, dp_level: str, method: str = "") -> tuple[str, str]:
    """(name, value) of an ``--inject-fault NAME[=VALUE]`` (value "" when it takes none), or
    a UsageError naming what is wrong."""
    name, _, value = spec.partition("=")
    name, value = name.strip(), value.strip()
    if name == "fedask_stage2_unnoised":
        raise UsageError(
            "inject_fault fedask_stage2_unnoised: FedASK's stage 2 carries no noise by design "
            "(Ỹ_k = A_kᵀ(B_kᵀQ) is post-processing of the DP-trained B_k with public A_k and "
            "Q); the closest real fault is fedask_stage1_unnoised"
        )
    if name not in FAULTS:
        raise UsageError(f"unknown inject_fault {name!r}; choose one of {sorted(FAULTS)}")
    level, kind = FAULTS[name]
    if dp_level == "none" or (level != "any" and dp_level != level):
        raise UsageError(
            f"inject_fault {name} plants a fault in "
            + ("DP training" if level == "any" else f"{level}-level DP")
            + f": it needs --dp-level {'sample or client' if level == 'any' else level} "
            f"(got {dp_level})"
        )
    if kind is None and value:
        raise UsageError(f"inject_fault {name} takes no value (got {value!r})")
    if kind == "float":
        try:
            f = float(value)
        except ValueError:
            raise UsageError(
                f"inject_fault {name}=F needs a number F >= 0, got {value!r}"
            ) from None
        if not (math.isfinite(f) and f >= 0 and f != 1.0):
            raise UsageError(f"inject_fault {name}=F needs a finite F >= 0 other than 1, got {f}")
    if isinstance(kind, tuple) and value not in kind:
        raise UsageError(f"inject_fault {name}=V needs V in {list(kind)}, got {value!r}")
    if name == "fedask_stage1_unnoised" and method != "fedask":
        raise UsageError(f"inject_fault {name} needs --method fedask (got {method})")
    if method == "fedpower" and dp_level == "client" and name in ("noise_scale", FAULT_SERVER):
        raise UsageError(
            f"inject_fault {name} hooks the server noise of the dense client-level average; "
            "FedPower's noisy power iteration is not hooked"
        )
    return name, value


#: largest count a config field may hold (rounds, steps, sizes, ...): beyond it nothing
#: trains in reasonable time, and Python's big integers would overflow floats and torch
MAX_COUNT = 10**9
#: largest target ε: beyond it the guarantee says nothing (a likelihood ratio of e^100)
#: and calibrating σ for it takes minutes
MAX_EPSILON = 100.0
#: largest σ: calibration never goes past it either (fl.privacy.accounting), and the
#: accountants overflow far above it
MAX_NOISE_MULTIPLIER = 1e6
#: smallest δ: the accountants' grids slow down without bound below it
MIN_DELTA = 1e-12
#: largest clipping bound (the noise σ·C stays far from float32's range)
MAX_CLIP = 1e12
#: largest LoRA rank, local epochs and rounds (counts above these only hang)
MAX_RANK = 4096
MAX_LOCAL_EPOCHS = 1000.0
MAX_ROUNDS = 100_000
MAX_LOCAL_STEPS = 1_000_000
#: tokens per example: at most this (and at most the model's positions: fl.run.setup)
MAX_LENGTH = 32768


def _method_names() -> tuple[str, ...]:
    from fl.methods import registry

    return tuple(registry.names())


@dataclass
class TrainConfig:
    method: str = _f(
        "fedavg",
        "federated method (see `fedlora train --list-methods`)",
        choices=_method_names,
    )
    model: str = _f(
        "minilm",
        "a model name or the path to a local HF model folder",
        examples=("minilm", "tiny-bert", "tiny-gpt2"),
    )
    dataset: str = _f(
        "tweets",
        "a dataset name or the path to a .csv/.jsonl file",
        examples=("tweets", "tweets3", "bbc", "synthetic"),
    )
    task: str = _f(
        "classification",
        "what is trained: classification = a sequence classifier (LoRA + head), causal-lm = "
        "next-token loss of a causal LM (LoRA only; docs/causal_lm.md)",
        choices=("classification", "causal-lm"),
    )
    lm_format: str = _f(
        "auto",
        "causal-lm data format: text = the text column as plain text (loss on every token), "
        "instruction = prompt and response fields (loss on the response tokens only), auto "
        "= instruction when a local file has the prompt field, else text",
        choices=("auto", "text", "instruction"),
    )
    prompt_field: str = _f("prompt", "prompt field of a local instruction dataset (causal-lm)")
    response_field: str = _f(
        "response", "response field of a local instruction dataset (causal-lm)"
    )
    precision: str = _f(
        "fp32",
        "compute precision of the forward/backward pass: fp32, or bf16 autocast (weights "
        "and the released adapter stay fp32)",
        choices=("fp32", "bf16"),
    )
    text_column: str = _f("text", "text column of a local dataset file")
    label_column: str = _f("label", "label column of a local dataset file")
    max_length: int = _f(64, "tokens per example (truncation length)")
    members: int = _f(10000, "examples in the federated training pool (members)")
    nonmembers: int = _f(1000, "held-out examples of the same distribution (for attacks)")
    test: int = _f(1000, "test examples for evaluation")
    clients: int = _f(5, "number of clients K")
    clients_per_round: float = _f(
        0, "clients sampled per round: a count >= 1, a fraction in (0,1), or 0 for all"
    )
    client_sampling: str = _f(
        "uniform",
        "how cohorts are drawn: uniform = a fixed count without replacement, poisson = each client w.p. q",
        choices=("uniform", "poisson"),
    )
    rounds: int = _f(5, "federated rounds")
    local_steps: int = _f(10, "local optimizer steps per round (ignored if local_epochs > 0)")
    local_epochs: float = _f(0.0, "local epochs per round (0 = use local_steps)")
    batch_size: int = _f(256, "(expected) batch size of a local step")
    lr: float = _f(1e-3, "local learning rate of the LoRA factors")
    head_lr: float = _f(
        3e-2, "local learning rate of the classification head (0 = the same as --lr)"
    )
    optimizer: str = _f(
        "adamw", "local optimizer (each client has its own state)", choices=("sgd", "adamw")
    )
    reset_optimizer: bool = _f(
        True, "reset each client's optimizer state every round (else keep it per client)"
    )
    weight_decay: float = _f(0.0, "AdamW weight decay")
    lr_schedule: str = _f(
        "constant",
        "per-round multiplier of both learning rates: constant, or cosine = "
        "(1 + cos(π r / R)) / 2 in round r = 0 .. R-1 (1 in the first round, near 0 in the last)",
        choices=("constant", "cosine"),
    )
    head_warmup_rounds: int = _f(
        0,
        "train only the classification head in the first N rounds, the LoRA factors "
        "frozen (linear probing, then fine-tuning); FedAvg-LoRA and its variants only; "
        "the DP mechanism and its accounting are unchanged",
    )
    rank: int = _f(8, "LoRA rank R")
    alpha: float = _f(16.0, "LoRA alpha (scaling s = alpha / R)")
    lora_dropout: float = _f(0.0, "LoRA dropout")
    dropout: str = _f(
        "model",
        "the base model's dropout (hidden, attention, classifier) while training: model = "
        "its config's probabilities; off = none, so a training is a function of its data, "
        "coins and noise only (a neighbour replay then needs no reference pass on D: "
        "docs/replay.md)",
        choices=("model", "off"),
    )
    target_modules: str = _f("", "comma-separated LoRA target modules (empty = per-model default)")
    lora_layers: int = _f(
        2,
        "LoRA on the top N transformer layers only (0 = every layer); the frozen layers "
        "below are computed once per example (see --prefix-cache)",
    )
    pooling: str = _f(
        "auto",
        "what the head reads: cls = the model's own pooler (BERT's CLS pooler, GPT-2's last "
        "token), mean = mean of the hidden states, auto = the model folder's pooling config "
        "(mean for minilm, cls for the tiny models)",
        choices=("auto", "cls", "mean"),
    )
    head_init: str = _f("zero", "classification head initialization", choices=("zero", "random"))
    prefix_cache: bool = _f(
        True,
        "compute the frozen layers below the LoRA layers once per example and train from "
        "the cached hidden states (BERT-family models; same outputs up to float rounding)",
    )
    length_buckets: bool = _f(
        True,
        "on the CPU, run each training batch as a few sub-batches of similar length, each "
        "padded only to its own longest sequence (per-example gradients unchanged up to "
        "float rounding; about a third less compute on tweets). GPUs: one pass per batch",
    )
    physical_batch: int = _f(
        0,
        "gradient accumulation: at most this many examples per forward/backward pass, a "
        "logical (Poisson) batch cut into passes whose per-example gradients are joined "
        "before the step's one clipping and one noise draw (the privacy ledger, canaries and "
        "replay count logical steps); 0: one pass per batch. Bounds activation memory",
    )
    client_ranks: str = _f(
        "", "heterogeneous ranks: draw each client's rank from this set, e.g. 4,8,16"
    )
    client_ranks_list: str = _f("", "heterogeneous ranks: one rank per client, e.g. 4,8,16,16,8")
    partition: str = _f("iid", "client partition", choices=("iid", "dirichlet"))
    dirichlet_alpha: float = _f(0.5, "Dirichlet concentration (smaller = more label skew)")
    min_client_size: int = _f(8, "smallest allowed client; Dirichlet draws are redrawn below it")
    dp_level: str = _f(
        "auto",
        "differential privacy: sample = DP-SGD on clients, client = server-side DP, none; "
        "auto = sample when --epsilon or --noise-multiplier is given, else none",
        choices=("auto", "none", "sample", "client"),
    )
    epsilon: float = _f(0.0, "target ε for the whole run (calibrates σ); 0 = not set")
    noise_multiplier: float = _f(-1.0, "σ given directly (instead of --epsilon); -1 = not set")
    delta: float = _f(0.0, "δ; 0 = 1/(10·n) with n the smallest accounting population")
    clip: float = _f(
        1.0, "clipping bound C (per example at sample level, per client update at client level)"
    )
    head_clip_share: float = _f(
        0.0,
        "sample-level DP-SGD: the share s of the squared clipping bound kept for the "
        "classification head; each example's head gradient is clipped to C·√s and the "
        "rest (the LoRA factors) to C·√(1−s), so its whole gradient stays within C and "
        "the noise and accounting are unchanged (0 = one joint clip)",
    )
    accountant: str = _f(
        "pld", "accountant for calibration and the budget check", choices=("pld", "rdp")
    )
    insecure_deterministic_noise: bool = _f(
        False,
        "NOT PRIVATE (tests only): draw DP noise, batches and cohorts from the public seed, "
        "so anyone who knows the seed can regenerate and subtract the noise; the default "
        "draws them from a keyed CSPRNG with a fresh secret key in RUN/private/noise.key",
    )
    canaries: int = _f(0, "number of audit canaries (each inserted with probability 1/2)")
    canary_kind: str = _f(
        "mislabel",
        "canary kind: mislabel / random_text = input canaries (texts added to a client's "
        "data, scored by their loss under the released adapter); gradient = white-box "
        "Dirac canaries of sample-level DP-SGD (each owns one trained coordinate and, "
        "when sampled, adds C there to its client's clipped sum before the noise; scored "
        "from the privatized step sums, docs/privacy.md)",
        choices=("mislabel", "random_text", "gradient"),
    )
    canary_clients: int = _f(
        0,
        "client-level DP audit (Andrew et al. 2024): M canary clients, each included with "
        "probability 1/2; an included one adds a fixed random update of norm C (drawn from "
        "the secret key, in the space the server clips) to the clipped sum before the "
        "server's noise in every round it takes part in (docs/audit.md); 0 = none",
    )
    sampler_canaries: int = _f(
        0,
        "sample-level DP audit of the batch sampling: M records per client that the "
        "trainer's own sampler draws into batches, each with a gradient of norm C on a "
        "coordinate of its own; the audit tests that their appearances are what Poisson "
        "sampling gives (docs/audit.md, Sampler canaries); changes the real examples' "
        "batches (the masks cover M more rows) but not the ledger; 0 = none",
    )
    inject_fault: str = _f(
        "",
        "TESTS ONLY, for auditing the auditor: plant one privacy fault NAME[=VALUE] in the "
        "training code path (noise_scale=F, no_clip, head_unnoised, factor_unnoised=A|B, "
        "noise_reuse, fixed_batches, server_noise_omitted, fedask_stage1_unnoised; "
        "docs/audit.md, Planted faults). The ledger is unchanged, so the run is NOT private: "
        "it writes no release bundle and `fedlora export` refuses it; empty = none",
    )
    eval_every: int = _f(1, "evaluate the global model every N rounds (and always at the end)")
    eval_batch_size: int = _f(128, "batch size for evaluation")
    eval_nonmembers: bool = _f(
        False,
        "after the last round also evaluate on the non-member pool (disjoint from members "
        "and test): val_accuracy / val_balanced_accuracy, for choosing hyperparameters "
        "without looking at the test set",
        runtime="run",
    )
    seed: int = _f(
        0,
        "public seed: data split, partition, initialization, FedASK's Ω, dropout (never "
        "the DP noise, batches or cohorts, which come from the run's secret noise key)",
    )
    # device: a resume or a replay may run elsewhere (a CUDA run's floats round
    # differently from the CPU's; the audit compares those within CUDA_RTOL).
    device: str = _f(
        "auto",
        "torch device (checked when the run starts: fl.models.base.resolve_device)",
        examples=("auto", "cpu", "cuda", "cuda:N"),
        runtime="run",
    )
    # transport: every client computes the same either way (the ClientApp rebuilds its
    # engine in-process), so the ClientApp's fingerprint ignores it; a resume keeps it
    # (the checkpoint compares it; the engine replays an interrupted round bit-exactly
    # only on the same transport).
    transport: str = _f(
        "inprocess",
        "how the server reaches its clients",
        choices=("inprocess", "flower"),
        runtime="client",
    )
    progress: bool = _f(True, "show progress bars", runtime="run")
    opts: dict = field(
        default_factory=dict,
        metadata={"help": "method options key=value (repeatable --opt)", "cli": False},
    )

    def __post_init__(self):
        self.resolve_dp_level()

    def resolve_dp_level(self) -> None:
        """``auto`` becomes ``sample`` when a target ε or a σ is set, else ``none``."""
        if self.dp_level == "auto":
            given = self.epsilon > 0 or self.noise_multiplier >= 0
            self.dp_level = "sample" if given else "none"

    def validate(self) -> TrainConfig:
        def need(cond: bool, msg: str):
            if not cond:
                raise UsageError(msg)

        self.resolve_dp_level()

        for f in fields(self):
            allowed = field_choices(f)
            value = getattr(self, f.name)
            need(
                allowed is None or value in allowed,
                f"unknown {f.name} {value!r}; choose one of {list(allowed or ())}",
            )
        need(
            0 <= self.seed < 2**63 - 1,
            f"seed must be an integer in [0, 2^63 - 1), got {self.seed}",
        )
        need(
            4 <= self.max_length <= MAX_LENGTH,
            f"max_length must be in [4, {MAX_LENGTH}], got {self.max_length}",
        )
        need(self.members > 0, f"members must be > 0, got {self.members}")
        need(
            self.nonmembers >= 0 and self.test > 0,
            f"nonmembers must be >= 0 and test > 0, got {self.nonmembers} and {self.test}",
        )
        need(self.clients >= 1, f"clients must be >= 1, got {self.clients}")
        need(
            self.clients <= self.members,
            f"clients ({self.clients}) must be <= members ({self.members}): "
            "every client needs at least one example",
        )
        need(
            self.min_client_size >= 0,
            f"min_client_size must be >= 0, got {self.min_client_size}",
        )
        cpr = self.clients_per_round
        need(
            cpr == 0 or (0 < cpr < 1) or (1 <= cpr <= self.clients and float(cpr).is_integer()),
            f"clients_per_round must be 0, a fraction in (0,1) or a count <= clients, got {cpr}",
        )
        need(
            1 <= self.rounds <= MAX_ROUNDS,
            f"rounds must be in [1, {MAX_ROUNDS}], got {self.rounds}",
        )
        need(
            self.local_steps >= 1 or self.local_epochs > 0,
            f"local_steps must be >= 1, got {self.local_steps}",
        )
        need(
            self.local_steps <= MAX_LOCAL_STEPS,
            f"local_steps must be <= {MAX_LOCAL_STEPS}, got {self.local_steps}",
        )
        need(
            0 <= self.local_epochs <= MAX_LOCAL_EPOCHS,
            f"local_epochs must be in [0, {MAX_LOCAL_EPOCHS:g}], got {self.local_epochs}",
        )
        need(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        need(
            self.eval_batch_size >= 1,
            f"eval_batch_size must be >= 1, got {self.eval_batch_size}",
        )
        need(
            self.weight_decay >= 0 and math.isfinite(self.weight_decay),
            f"weight_decay must be a finite number >= 0, got {self.weight_decay}",
        )
        need(self.lr > 0 and math.isfinite(self.lr), f"lr must be > 0, got {self.lr}")
        need(
            self.head_lr >= 0 and math.isfinite(self.head_lr),
            f"head_lr must be >= 0 (0 = the same as lr), got {self.head_lr}",
        )
        need(self.lora_layers >= 0, f"lora_layers must be >= 0, got {self.lora_layers}")
        need(self.physical_batch >= 0, f"physical_batch must be >= 0, got {self.physical_batch}")
        need(1 <= self.rank <= MAX_RANK, f"rank must be in [1, {MAX_RANK}], got {self.rank}")
        need(self.alpha > 0 and math.isfinite(self.alpha), f"alpha must be > 0, got {self.alpha}")
        need(0 <= self.lora_dropout < 1, f"lora_dropout must be in [0,1), got {self.lora_dropout}")
        need(
            self.dropout == "model" or self.lora_dropout == 0,
            f"dropout='off' turns every dropout off: lora_dropout must be 0, got {self.lora_dropout}",
        )
        need(
            self.dirichlet_alpha > 0 and math.isfinite(self.dirichlet_alpha),
            f"dirichlet_alpha must be a finite number > 0, got {self.dirichlet_alpha}",
        )
        need(
            self.epsilon == 0 or 0 < self.epsilon <= MAX_EPSILON,
            f"epsilon must be a number in (0, {MAX_EPSILON:g}], got {self.epsilon}",
        )
        need(
            self.noise_multiplier == -1.0 or 0 <= self.noise_multiplier <= MAX_NOISE_MULTIPLIER,
            f"noise multiplier σ must be a number in [0, {MAX_NOISE_MULTIPLIER:g}], "
            f"got {self.noise_multiplier}",
        )
        need(
            self.delta == 0 or MIN_DELTA <= self.delta < 1,
            f"delta must be in [{MIN_DELTA:g}, 1), got {self.delta}",
        )
        need(
            0 < self.clip <= MAX_CLIP,
            f"clipping bound C must be in (0, {MAX_CLIP:g}], got {self.clip}",
        )
        need(
            0 <= self.head_clip_share < 1,
            f"head_clip_share must be in [0, 1), got {self.head_clip_share}",
        )
        need(
            self.head_clip_share == 0 or self.dp_level == "sample",
            "head_clip_share splits the per-example clip of sample-level DP-SGD: it needs "
            f"--dp-level sample (got {self.dp_level})",
        )
        need(
            0 <= self.head_warmup_rounds < self.rounds,
            f"head_warmup_rounds must be in [0, rounds) = [0, {self.rounds}), got "
            f"{self.head_warmup_rounds} (with every round head-only, use --method probe)",
        )
        need(self.canaries >= 0, f"canaries must be >= 0, got {self.canaries}")
        need(self.canary_clients >= 0, f"canary_clients must be >= 0, got {self.canary_clients}")
        need(
            self.canary_clients == 0 or self.dp_level == "client",
            "--canary-clients audits client-level DP: it needs --dp-level client "
            f"(got {self.dp_level})",
        )
        if self.canary_kind == "gradient" and self.canaries > 0:
            need(
                self.dp_level == "sample",
                "--canary-kind gradient enters sample-level DP-SGD's clipped sums: it needs "
                f"--dp-level sample (got {self.dp_level})",
            )
            need(
                self.transport == "inprocess",
                "--canary-kind gradient records the privatized step sums in the operator's "
                "run directory: it needs --transport inprocess",
            )
        need(
            self.sampler_canaries >= 0,
            f"sampler_canaries must be >= 0, got {self.sampler_canaries}",
        )
        if self.sampler_canaries > 0:
            need(
                self.dp_level == "sample",
                "--sampler-canaries audits the batch sampling of sample-level DP-SGD: it needs "
                f"--dp-level sample (got {self.dp_level})",
            )
            need(
                self.transport == "inprocess",
                "--sampler-canaries records the privatized step sums in the operator's run "
                "directory: it needs --transport inprocess",
            )
        if self.inject_fault:
            parse_fault(self.inject_fault, self.dp_level, self.method)
        need(self.eval_every >= 1, f"eval_every must be >= 1, got {self.eval_every}")
        for f in fields(self):  # the rest: no count beyond MAX_COUNT, no float NaN
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if f.name == "seed":
                continue
            need(
                not (isinstance(value, float) and math.isnan(value)),
                f"{f.name} must be a number, got nan",
            )
            if isinstance(value, int):
                need(abs(value) <= MAX_COUNT, f"{f.name} must be <= {MAX_COUNT}, got {value}")
        if self.dp_level != "none":
            need(
                (self.epsilon > 0) != (self.noise_multiplier >= 0),
                "with DP give exactly one of --epsilon and --noise-multiplier",
            )
        else:
            need(
                self.epsilon == 0 and self.noise_multiplier == -1.0,
                "--epsilon/--noise-multiplier cannot be used with --dp-level none "
                "(leave --dp-level out for sample level, or say sample or client)",
            )
        return self

    def lr_scale(self, round_index: int) -> float:
        """The multiplier of both learning rates in round ``round_index`` (0-based):
        1 for ``constant``; (1 + cos(π r / R)) / 2 for ``cosine``."""
        if self.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * round_index / self.rounds))
        return 1.0

    def head_only(self, round_index: int) -> bool:
        """Whether round ``round_index`` (0-based) trains the head alone (warm-up)."""
        return round_index < self.head_warmup_rounds

    def to_dict(self) -> dict:
        return asdict(self)

    def sha256(self) -> str:
        """:func:`config_sha256` of this configuration."""
        return config_sha256(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        if not isinstance(d, dict):
            raise UsageError("config must be a table/object")
        known = {f.name: f for f in fields(cls)}
        if "secure_rng" in d:
            raise UsageError(
                "config field 'secure_rng' is gone: DP noise is always drawn from the run's "
                "keyed CSPRNG now (remove the field; --insecure-deterministic-noise is the "
                "non-private exception for tests)"
            )
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise UsageError(f"unknown config field(s): {unknown}")
        kw = {}
        for k, v in d.items():
            kw[k] = _coerce(known[k], v)
        return cls(**kw)


def field_choices(f) -> tuple | None:
    """The valid values of a config field (a :func:`dataclasses.field`), or None when any
    value of its type is accepted. Callable choices (the registered methods) are resolved
    here, at use."""
    c = f.metadata.get("choices")
    if c is None:
        return None
    return tuple(c() if callable(c) else c)


def runtime_fields(scope: str = "run") -> tuple[str, ...]:
    """Names of the config fields that do not change results (metadata ``runtime``).

    ``scope="run"``: fields a resume, replay or audit may change (``progress``,
    ``device``): they are taken from the command line on ``--resume`` and ignored when a
    checkpoint's or a manifest's config is compared. ``scope="client"``: also the fields
    that do not change what one client computes (``transport``): the Flower ClientApp's
    configuration fingerprint ignores them.
    """
    if scope not in ("run", "client"):
        raise ValueError(f"unknown scope {scope!r}; choose one of ['run', 'client']")
    want = ("run",) if scope == "run" else ("run", "client")
    return tuple(f.name for f in fields(TrainConfig) if f.metadata.get("runtime") in want)


def result_fields() -> tuple[str, ...]:
    """Names of the config fields that change results (every field not in
    :data:`RUNTIME_FIELDS`): a resumed or replayed run must keep each of them."""
    skip = set(runtime_fields("run"))
    return tuple(f.name for f in fields(TrainConfig) if f.name not in skip)


#: config fields that do not change the run's results: ("device", "progress")
RUNTIME_FIELDS: tuple[str, ...] = runtime_fields("run")


def config_sha256(cfg: TrainConfig | dict) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of a configuration without
    its :data:`RUNTIME_FIELDS` and transport: equal for a run and its bit-exact replay. A noise key's
    binding (``private/key_binding.json``) names the configuration it was made for."""
    d = cfg.to_dict() if isinstance(cfg, TrainConfig) else dict(cfg)
    # the transport moves the same computation elsewhere (Flower gives the in-process
    # run's adapter and ledger bit for bit), so a run replayed on another is a replay
    for k in (*RUNTIME_FIELDS, "transport"):
        d.pop(k, None)
    text = json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def field_type(f) -> type:
    """The type a config field's values are coerced to: its annotation where that is a
    plain ``int``, ``float``, ``bool`` or ``str`` (``clients_per_round: float`` has the
    integer default 0 but takes fractions), else the default's type."""
    name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    default = f.default if f.default is not MISSING else None
    return {"int": int, "float": float, "bool": bool, "str": str}.get(name, type(default))


def _coerce(f, v):
    if f.name == "opts":
        if not isinstance(v, dict):
            raise UsageError("config field 'opts' must be a table")
        return dict(v)
    typ = field_type(f)
    if typ is float and isinstance(f.default, int) and isinstance(v, int):
        # a float field with an integer default (clients_per_round): a count stays an
        # int, so config.json round-trips unchanged
        if isinstance(v, bool):
            raise UsageError(f"config field {f.name!r} must be a number, got {v!r}")
        return v
    if typ is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.lower() in ("true", "1", "yes", "false", "0", "no"):
            return v.lower() in ("true", "1", "yes")
        raise UsageError(f"config field {f.name!r} must be true/false, got {v!r}")
    if typ is int:
        if isinstance(v, bool) or not (
            isinstance(v, int) or (isinstance(v, str) and v.lstrip("-").isdigit())
        ):
            raise UsageError(f"config field {f.name!r} must be an integer, got {v!r}")
        return int(v)
    if typ is float:
        try:
            if isinstance(v, bool):
                raise ValueError
            return float(v)
        except (TypeError, ValueError):
            raise UsageError(f"config field {f.name!r} must be a number, got {v!r}") from None
    if typ is str:
        if not isinstance(v, str | int | float) or isinstance(v, bool):
            raise UsageError(f"config field {f.name!r} must be a string, got {v!r}")
        return str(v)
    return v


def load_toml(path: str) -> dict:
    """The fields of a config file: TOML (a ``[train]`` table or top-level keys) or, for
    a name ending in ``.json``, a JSON object such as a run directory's ``config.json``
    (so that a run can be repeated with ``--config RUN/config.json --seed ...``)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file not found: {path}")
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path}: invalid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise UsageError(f"{path}: a JSON config must be an object of fields")
        return data
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: invalid TOML ({exc})") from None
    return data.get("train", data)
