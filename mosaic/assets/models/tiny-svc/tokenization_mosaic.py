"""Written by Mosaic next to a saved tokenizer; loaded only with ``trust_remote_code=True``.

The stock fast tokenizer reading ``tokenizer.json`` as saved; it adds no code. It exists because
``tokenizer_config.json`` carries an ``auto_map`` entry, which keeps transformers from swapping in
a model-specific tokenizer class that pre-tokenises differently (other token ids).
"""

from transformers import PreTrainedTokenizerFast


class MosaicTokenizer(PreTrainedTokenizerFast):
    """``PreTrainedTokenizerFast``, under a name the ``auto_map`` entry can point at."""
