"""The bundle: a run directory or a released bundle (``fedlora audit RUN``).

Takes what a run released (manifest, adapter, metrics, and, for the operator, the private
folder and key) and gives findings: the files' integrity and seal, the cross-checks between a
privacy field's copies, ε recomputed from the mechanism that was run (``recompute``), the replay
of the training under the key (``replay``), and the one-run canary audit of a run's own
canaries (``audit``).
"""
