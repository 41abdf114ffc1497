"""Training: everything behind `mfqat train`, and the run summary every training command writes.

Owns: ``loop`` (the accelerate training loop: one process, DDP, FSDP; `mfqat train`,
scripts/train.py), ``args`` (its flags and their checks, argparse only), ``setup`` (config
overrides, LR schedule, data, trackers, importance, memory checks), ``optim`` (AdamW / bnb 8-bit),
``lora`` (peft LoRA, bitsandbytes NF4/INT8 bases, merged copies for anchors), ``fsdp`` (FSDP2 on
CPU ranks), ``grad_compress`` (the MX-compressed DDP gradient hook), ``summary`` (OUT/summary.json
of `mfqat train`, `mfqat mx-qlora` and `mfqat mlx-train`: one writer, one set of key names).

May import: formats, progress, quant, storage, models, qat, anchor, data, eval, export. Never
integrations, mxqlora, mlx or cli. Importing this package imports nothing; ``args`` imports no torch
(the CLI checks flags with it before anything heavy loads).
"""
