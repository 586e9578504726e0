"""A small Opacus training for the neighbour replay tests (fedlora audit-script): a 10-8-2
MLP on 200 synthetic records, Poisson batches of expected size 20, one epoch. --no-clip plants
the bug of an old release (the clip ignored: max_grad_norm 1e9 with the noise kept at 1·1);
--print-loss prints the last batch loss (a release without noise)."""

import sys

import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
X = torch.randn(200, 10, generator=g)
y = (X[:, 0] > 0).long()
model = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(X, y), batch_size=20)
pe = PrivacyEngine()
model, opt, loader = pe.make_private(
    module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
)
BUG = "--no-clip" in sys.argv
if BUG:  # an old release's bug, planted: the per-sample clip ignores max_grad_norm
    opt.max_grad_norm = 1e9
    opt.noise_multiplier = 1e-9
for xb, yb in loader:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
if "--print-time" in sys.argv:  # differs on every run, data or not: never a finding
    import time

    print(f"took {time.perf_counter()}")
if "--print-loss" in sys.argv:
    print(f"final loss {loss.item():.6f}")
print("done")
