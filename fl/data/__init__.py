"""Data: datasets, tokenization and splits.

Takes a dataset name or local file and gives the examples, their member / non-member / test
splits and the clients' partitions (``datasets``), causal-LM texts and instruction pairs (``lm``),
and tokenized tensors with cached frozen-layer features (``tokenized``).
"""
