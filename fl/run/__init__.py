"""A run: configuration, plan, engine, rounds and the run directory.

Takes a :class:`fl.run.config.TrainConfig` and gives a run directory: the privacy plan
(``plan``), the engine's round loop (``engine``, ``setup``, ``contexts``, ``trainer``,
``local_step``, ``transport``; the method contract it drives is
:mod:`fl.methods.rounds`), checkpoints and in-flight records
(``checkpoint``, ``inflight``), and the files a run writes and releases (``rundir``,
``manifest``, ``release``, ``integrity``).

The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "TrainConfig": "fl.run.config",
    "config_sha256": "fl.run.config",
    "train": "fl.run.engine",
    "Engine": "fl.run.engine",
    "STOP_FILE": "fl.run.engine",
    "TrainResult": "fl.run.trainer",
    "read_manifest": "fl.run.rundir",
    "read_config": "fl.run.rundir",
    "read_splits": "fl.run.rundir",
    "read_metrics": "fl.run.rundir",
    "is_release": "fl.run.rundir",
    "SCHEMA_VERSION": "fl.run.rundir",
    "write_release": "fl.run.release",
    "public_manifest": "fl.run.release",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
