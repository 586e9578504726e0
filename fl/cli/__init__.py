"""The commands: ``fedlora train`` (``train``), ``fedlora export`` (``export``) and ``fedlora base
pretrain`` (``pretrain``). Building their parsers imports no torch.
"""
