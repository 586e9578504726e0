"""The Flower ``ServerApp``: its main runs the engine's round loop — the method's server
program — over ``grid.send_and_receive`` (``fl.flower.transport.FlowerTransport``).

Run configuration (``[tool.flwr.app.config]`` of ``flower_app/pyproject.toml``, or
``flwr run --run-config``): every TrainConfig field by name (``-`` or ``_``), method
options as ``opts.<key>``, plus

- ``out-dir`` (required): the run directory, written by the process that runs the
  ServerApp (on the SuperLink's machine in a deployment);
- ``resume`` (bool): continue a stopped run from ``out-dir/checkpoint`` (the ledger is
  restored, not reset);
- ``stage-timeout`` (seconds): how long a stage waits for replies (a silent client is
  then a failed client);
- ``noise-key`` (path, optional): reuse this secret noise key (a replay) instead of a
  fresh one. Each SuperNode finds the key through its node config
  ``noise-key-file=PATH``, or else at the path the server names (same machine).
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

RESERVED = ("out-dir", "resume", "stage-timeout", "noise-key")


def config_from_run_config(rc: dict):
    """(TrainConfig, out_dir, resume, timeout, noise_key) from a Flower run config."""
    from fl.errors import UsageError
    from fl.run.config import TrainConfig

    d: dict = {}
    opts: dict = {}
    for k, v in rc.items():
        if k in RESERVED:
            continue
        if k.startswith("opts."):
            opts[k[5:]] = v
        else:
            d[k.replace("-", "_")] = v
    d["opts"] = opts
    d["transport"] = "flower"
    d.setdefault("progress", False)
    out = rc.get("out-dir")
    if not out:
        raise UsageError("flower run config needs out-dir (the run directory)")
    timeout = rc.get("stage-timeout")
    return (
        TrainConfig.from_dict(d),
        str(out),
        bool(rc.get("resume", False)),
        float(timeout) if timeout else None,
        str(rc.get("noise-key") or "") or None,
    )


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    from fl.flower.transport import bind_grid
    from fl.run.engine import Engine

    cfg, out, resume, timeout, key = config_from_run_config(dict(context.run_config))
    with bind_grid(grid, timeout):
        manifest = Engine(cfg, out, resume=resume, quiet=False, noise_key=key).run()
    eps = manifest["privacy"]["epsilon"]["pld"]
    print(
        f"fedlora: run complete in {out} (rounds {manifest['privacy']['rounds_completed']}, "
        f"ε={eps if eps is not None else 'n/a'})",
        flush=True,
    )


__all__ = ["app", "main", "config_from_run_config"]
