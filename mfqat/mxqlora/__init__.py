"""MX-QLoRA: LoRA adapters on a frozen anchor held as packed MX codes.

Owns: ``model`` (the frozen packed layers, adapters, saving in PEFT's layout), ``train``
(`mfqat mx-qlora`), ``mlx_adapter`` (a PEFT adapter as an mlx-lm adapter folder).

May import: every layer below it (formats .. train, integrations). Never mlx or cli.
"""
