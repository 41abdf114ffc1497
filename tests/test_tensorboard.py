"""--report-to tensorboard and MFQATTrainer's per-format metrics, read back from real TensorBoard event files
(issue 33 item 11: the flag was refused with tensorboard installed; the per-format metrics were not checked there)."""
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch

pytest.importorskip("tensorboard")

import mfqat  # noqa: E402
from mfqat.data.sources import tiny_llama, tiny_tokenizer  # noqa: E402
from mfqat.train.loop import main as train_main  # noqa: E402
from mfqat.qat import QATConfig  # noqa: E402


def scalars(folder: Path) -> dict:
    """{tag: [(step, value), ...]} of every TensorBoard event file under ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = defaultdict(list)
    runs = {f.parent for f in folder.rglob("events.out.tfevents*")}
    assert runs, f"no TensorBoard event file under {folder}"
    for run in runs:
        acc = EventAccumulator(str(run))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out[tag] += [(e.step, e.value) for e in acc.Scalars(tag)]
    return dict(out)


def test_report_to_tensorboard_logs_every_formats_loss_and_perplexity(tmp_path):
    out = tmp_path / "run"
    s = train_main(["--model", "tiny", "--steps", "2", "--seq-len", "16", "--batch-size", "2", "--eval-blocks", "1",
                    "--qat-config", "mxint_joint", "--eval-formats", "mxint8,mxint4", "--report-to", "tensorboard",
                    "--out", str(out)])
    tb = scalars(out)
    assert [v for _, v in sorted(tb["train/loss"])] == pytest.approx(s["losses"], rel=1e-6)
    for fmt in ("mxint8", "mxint6", "mxint4"):  # the joint step's formats, each step
        assert sorted(step for step, _ in tb[f"train/loss_{fmt}"]) == [1, 2], fmt
    for row in s["eval"][:2]:
        (step, ppl), = tb[f"eval/{row['format']}_ppl"]
        assert step == 2 and ppl == pytest.approx(row["perplexity"], rel=1e-6)


def test_mfqat_trainer_per_format_eval_metrics_reach_tensorboard(tmp_path):
    from transformers import TrainingArguments

    from mfqat.integrations.hf import MFQATTrainer

    tok = tiny_tokenizer()
    model = mfqat.prepare(tiny_llama(vocab_size=len(tok)), QATConfig(formats=["mxint2", "mxint8"], schedule="cyclic"))
    ids = torch.randint(0, len(tok), (8, 32), generator=torch.Generator().manual_seed(0))
    ds = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, logging_steps=1, eval_strategy="steps", eval_steps=2,
                             save_strategy="no", report_to=["tensorboard"],
                             use_cpu=True)
    trainer = MFQATTrainer(model=model, args=args, train_dataset=ds, eval_dataset=ds, processing_class=tok,
                           eval_formats=["mxint2", "mxint8"])
    trainer.train()
    (logged,) = [h for h in trainer.state.log_history if "eval_mxint2_ppl" in h]
    tb = scalars(tmp_path / "out")
    for fmt in ("mxint2", "mxint8"):
        (step, ppl), = tb[f"eval/{fmt}_ppl"]
        assert step == 2 and ppl == pytest.approx(logged[f"eval_{fmt}_ppl"], rel=1e-6)
        assert math.isfinite(tb[f"eval/{fmt}_loss"][0][1])
    assert {step for step, _ in tb["train/mfqat_bits"]} == {1, 2}  # the callback's on_log, before the reporter


def test_plain_trainer_with_reporters_warns_that_per_format_metrics_miss_them(tmp_path):
    from transformers import Trainer, TrainingArguments

    from mfqat.integrations.hf import MFQATCallback

    tok = tiny_tokenizer()
    model = mfqat.prepare(tiny_llama(vocab_size=len(tok)), QATConfig(formats=["mxint2", "mxint8"], schedule="cyclic"))
    ds = [{"input_ids": r, "labels": r} for r in torch.randint(0, len(tok), (4, 16), generator=torch.Generator().manual_seed(0))]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
                             eval_strategy="steps", eval_steps=1, save_strategy="no", report_to=["tensorboard"],
                             use_cpu=True)
    cb = MFQATCallback(eval_formats=["mxint2"], anchor_format=None)
    with pytest.warns(UserWarning, match="eval_mxint2_.* reach.*not tensorboard.*MFQATTrainer"):
        Trainer(model=model, args=args, train_dataset=ds, eval_dataset=ds, callbacks=[cb]).train()
