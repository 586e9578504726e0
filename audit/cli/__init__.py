"""The commands: ``fedlora audit``, ``fedlora report`` (``audit``) and ``fedlora canaries``
(``canaries``). Building their parsers imports neither torch nor matplotlib.
"""
