"""A run: configuration, plan, engine, rounds and the run directory.

Takes a :class:`fl.run.config.TrainConfig` and gives a run directory: the privacy plan
(``plan``), the engine's round loop (``engine``, ``setup``, ``contexts``, ``trainer``,
``local_step``, ``transport``; the method contract it drives is
:mod:`fl.methods.rounds`), checkpoints and in-flight records
(``checkpoint``, ``inflight``), and the files a run writes and releases (``rundir``,
``manifest``, ``release``, ``integrity``).
"""
