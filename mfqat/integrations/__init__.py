"""Integrations with Hugging Face: the ``Trainer`` callback and ``MFQATTrainer`` (``hf``), and the
transformers ``HfQuantizer`` that loads anchors (``hf_quantizer``).

The training loop of `mfqat train` and its helpers moved to :mod:`mfqat.train`; their old paths here
(``train_loop``, ``train_args``, ``train_setup``, ``optim``, ``fsdp``, ``grad_compress``, ``lora``)
still import, with a DeprecationWarning, until the next release.
"""
