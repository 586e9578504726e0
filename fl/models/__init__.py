"""Models: base models, heads, causal LM and LoRA factors.

Takes a model name (``minilm``, ``tiny-bert``, ``tiny-gpt2``) or a local folder and gives the
frozen base with its tokenizer (``base``), the classification heads (``heads``), the causal-LM
path (``causal_lm``), the LoRA factors as plain tensors (``factors``) and the offline
pretraining of a small base (``pretrain``, ``pretrain_config``).

The pretraining itself is :func:`fl.models.pretrain.pretrain` (it shares its module's name,
so it is not re-exported here). The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "load_base_model": "fl.models.base",
    "load_tokenizer": "fl.models.base",
    "model_folder": "fl.models.base",
    "resolve_device": "fl.models.base",
    "tiny_model_config": "fl.models.base",
    "wrap_lora": "fl.models.base",
    "LoraSpec": "fl.models.base",
    "MODELS": "fl.models.base",
    "BertClassifier": "fl.models.heads",
    "Gpt2Classifier": "fl.models.heads",
    "load_causal_lm": "fl.models.causal_lm",
    "get_state": "fl.models.factors",
    "set_state": "fl.models.factors",
    "PretrainConfig": "fl.models.pretrain_config",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
