"""A Hugging Face Trainer + Opacus training as a user writes it, with no audit code: a tiny
BERT classifier (from a config, no download) on 160 synthetic token records (dicts), Opacus's
make_private (Poisson batches of expected size 16, flat clipping), the Trainer handed the DP
optimizer and Opacus's loader (a Trainer subclass), 10 noised steps. Run under
``fedlora audit-script`` (tests/audit/test_libraries_opacus_autoattach.py)."""

import torch
from opacus import PrivacyEngine
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
torch.set_num_threads(1)
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
N, L, V = 160, 8, 50
x = torch.randint(10, V, (N, L), generator=g)
y = torch.randint(0, 2, (N,), generator=g)
x[y == 1, 3] = 7
train = [{"input_ids": x[i], "attention_mask": torch.ones(L, dtype=torch.long), "labels": y[i]}
         for i in range(N)]  # fmt: skip
cfg = BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=32, max_position_embeddings=16, num_labels=2,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
model = BertForSequenceClassification(cfg)
for p in model.bert.embeddings.parameters():  # Opacus has no per-sample rule for position ids
    p.requires_grad_(False)
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
loader = torch.utils.data.DataLoader(train, batch_size=16, collate_fn=default_data_collator)
pe = PrivacyEngine(accountant="prv")
model, opt, loader = pe.make_private(
    module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
)


class DPTrainer(Trainer):
    def get_train_dataloader(self):  # Opacus's Poisson loader, not a shuffled one
        return loader


class ZeroGrad(TrainerCallback):  # the Trainer clears the model, not the DP optimizer
    def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
        opt.zero_grad(set_to_none=True)


args = TrainingArguments(output_dir="/tmp/hf-trainer-opacus-test", max_steps=10,
                         per_device_train_batch_size=16, learning_rate=0.05,
                         lr_scheduler_type="constant", remove_unused_columns=False,
                         label_names=["labels"], logging_strategy="no", save_strategy="no",
                         report_to="none", use_cpu=True, disable_tqdm=True, seed=0)  # fmt: skip
trainer = DPTrainer(model=model, args=args, optimizers=(opt, None), callbacks=[ZeroGrad()])
# the Trainer prints its final train_loss (a release without noise): not printed here
trainer.remove_callback(PrinterCallback)
trainer.train()
print("done")
