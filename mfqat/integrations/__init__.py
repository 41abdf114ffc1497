"""Integrations with Hugging Face: the ``Trainer`` callback and ``MFQATTrainer`` (``hf``), and the
transformers ``HfQuantizer`` that loads anchors (``hf_quantizer``). The training loop of
`mfqat train` and its helpers are in :mod:`mfqat.train`."""
