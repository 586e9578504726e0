"""Models: base models, heads, causal LM and LoRA factors.

Takes a model name (``minilm``, ``tiny-bert``, ``tiny-gpt2``) or a local folder and gives the
frozen base with its tokenizer (``base``), the classification heads (``heads``), the causal-LM
path (``causal_lm``), the LoRA factors as plain tensors (``factors``) and the offline
pretraining of a small base (``pretrain``, ``pretrain_config``).
"""
