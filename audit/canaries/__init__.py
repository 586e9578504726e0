"""Canaries: the run's own and those for trainings done elsewhere.

Takes a canary kind and count (or a run's canary observations) and gives canary sets
(``canary_set``: new, load, verify), hooks that put canaries into an outside training
(``hooks``: plain PyTorch, Opacus, Flower) and scores (``gradient``: white-box gradient canaries;
``clients``: canary clients at client level; ``outside``: audit of a training done
elsewhere).
"""
