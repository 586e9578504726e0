"""Data: datasets, tokenization and splits.

Takes a dataset name or local file and gives the examples, their member / non-member / test
splits and the clients' partitions (``datasets``), causal-LM texts and instruction pairs (``lm``),
and tokenized tensors with cached frozen-layer features (``tokenized``).

The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "load_dataset": "fl.data.datasets",
    "split_dataset": "fl.data.datasets",
    "partition": "fl.data.datasets",
    "Split": "fl.data.datasets",
    "TextDataset": "fl.data.datasets",
    "DATASETS": "fl.data.datasets",
    "load_lm_dataset": "fl.data.lm",
    "TokenizedData": "fl.data.tokenized",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
