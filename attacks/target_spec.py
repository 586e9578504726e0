"""How ``fedlora attack`` names a target: :class:`TargetSpec`, whose fields generate the
command's flags (one source of defaults and help); :meth:`TargetSpec.resolve` checks the
combination and builds the :class:`attacks.target.Target`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attacks.target import Target
from fl.errors import UsageError

__all__ = ["TargetSpec", "MAX_BATCH_SIZE", "MIN_MAX_LENGTH", "MAX_MAX_LENGTH"]

#: the range of ``--max-length`` before the model is known (its positions cap it further:
#: :func:`attacks.target.check_max_length`); 4 is the training pipeline's own minimum
MIN_MAX_LENGTH = 4
MAX_MAX_LENGTH = 1 << 24
MAX_BATCH_SIZE = 65536


def _f(help: str, default=None, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class TargetSpec:
    """How ``fedlora attack`` names a target: a run directory or a release bundle
    (``run_dir``), or a foreign adapter (``adapter``, ``model``); the candidate files
    (``members``, ``nonmembers``) for a bundle or an adapter."""

    run_dir: str | None = _f(
        "a finished fedlora run directory, or a release bundle (with --members and --nonmembers)",
        cli=False,  # the positional RUN_OR_BUNDLE
    )
    adapter: str | None = _f("PEFT LoRA adapter folder (adapter_model.safetensors)")
    model: str | None = _f("base model: minilm | tiny-bert | tiny-gpt2 | local folder")
    members: str | None = _f(
        "CSV/JSONL of member examples (formats: see below); also for a bundle", metavar="FILE"
    )
    nonmembers: str | None = _f(
        "CSV/JSONL of non-member examples, the same format as --members", metavar="FILE"
    )
    max_length: int = _f(
        "tokens per example, at least 4 and at most the base model's positions (a longer "
        "value is refused, naming the limit: 512 for minilm, 256 for tiny-bert / tiny-gpt2); "
        "use the adapter's training length",
        64,
    )
    base_seed: int = _f("seed of a random-init base model (tiny-bert, tiny-gpt2)", 0)
    shadow_config: str | None = _f(
        "TOML of TrainConfig fields for the reference pipeline (default: a bundle's "
        "configuration; for --adapter 1 client, non-private, TrainConfig defaults, the "
        "adapter's rank/alpha/dropout/target modules/layers and its head's pooling: cls)",
        metavar="TOML",
    )
    # (after the fields above: TargetSpec's positional order is kept)
    text_column: str = _f("text column of the --members / --nonmembers files", "text")
    label_column: str = _f(
        "label column of the --members / --nonmembers files (classification)", "label"
    )
    batch_size: int = _f(
        f"examples per forward pass when scoring an adapter (1..{MAX_BATCH_SIZE}; a run "
        "directory uses its eval_batch_size)",
        128,
    )

    def __post_init__(self):
        # numbers first: a bad one is refused before any file or model is read
        from attacks.config import MAX_SEED

        if not MIN_MAX_LENGTH <= self.max_length <= MAX_MAX_LENGTH:
            raise UsageError(
                f"--max-length must be in [{MIN_MAX_LENGTH}, the model's positions], "
                f"got {self.max_length}"
            )
        if not 0 <= self.base_seed <= MAX_SEED:
            raise UsageError(f"--base-seed must be in [0, 2**32 - 1], got {self.base_seed}")
        if not 1 <= self.batch_size <= MAX_BATCH_SIZE:
            raise UsageError(
                f"--batch-size must be in [1, {MAX_BATCH_SIZE}], got {self.batch_size}"
            )

    def resolve(self) -> Target:
        """The :class:`Target` named, or a UsageError for a combination that names none."""
        from fl.run.release import is_release

        foreign = [self.adapter, self.model, self.members, self.nonmembers]
        if self.run_dir and is_release(self.run_dir):
            if self.adapter or self.model:
                raise UsageError(
                    f"{self.run_dir} is a release bundle: it brings its adapter and base "
                    "model; give only --members FILE and --nonmembers FILE"
                )
            if not (self.members and self.nonmembers):
                raise UsageError(
                    f"{self.run_dir} is a release bundle: it carries no member list (that "
                    "lives in the operator's splits.json); give --members FILE and "
                    "--nonmembers FILE with the candidate examples"
                )
            return Target.from_bundle(
                self.run_dir,
                self.members,
                self.nonmembers,
                self._shadow_overrides(),
                **self._candidate_options(),
            )
        if self.run_dir:
            if any(foreign):
                raise UsageError("give either RUN_DIR or --adapter/--model/--members/--nonmembers")
            return Target.from_run(self.run_dir)
        if not all(foreign):
            raise UsageError(
                "give RUN_DIR, or all of --adapter, --model, --members and --nonmembers"
            )
        return Target.from_adapter(
            self.adapter,
            self.model,
            self.members,
            self.nonmembers,
            max_length=self.max_length,
            base_seed=self.base_seed,
            shadow_config=self._shadow_overrides(),
            **self._candidate_options(),
        )

    def _candidate_options(self) -> dict:
        return dict(
            text_column=self.text_column,
            label_column=self.label_column,
            batch_size=self.batch_size,
        )

    def _shadow_overrides(self) -> dict | None:
        """The --shadow-config TOML's fields (a run directory's shadows ignore it)."""
        if not self.shadow_config:
            return None
        from fl.run.config import load_toml

        return load_toml(self.shadow_config)
