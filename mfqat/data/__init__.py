"""Data: text and models every machine has, and the user's JSON-lines datasets.

Owns: ``sources`` (pydoc text, the embedded SmolLM2-135M, tiny Llamas, an anchor given as a model),
``jsonl`` (``--dataset`` / ``--data`` in mlx-lm's layout).

May import: formats, progress, quant, storage, models, qat, anchor. Never eval, export, mlx or cli.
"""
