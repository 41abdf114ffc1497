#!/usr/bin/env python
"""Pre-release check: do the tests fail when the product breaks?

Each entry below plants one named bug (replace ``old`` by ``new`` in one file, exactly once) in a
temporary copy of the repository and runs only the tests expected to catch it, with PYTHONPATH
pointing at the copy. A mutation is *caught* when those tests fail; it *survives* when they pass
(a test gap). Before any mutation the same tests run once on the unmodified copy and must pass.

    python scripts/mutation_check.py             # all mutations (a few minutes on 2 cores)
    python scripts/mutation_check.py -k nf4      # those whose name contains "nf4"
    python scripts/mutation_check.py --list

Prints caught/planted and exits 1 when a mutation survives (or a spec no longer applies).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

ROOT = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(".venv", ".git", "out", "runs", "__pycache__", ".pytest_cache", ".hypothesis",
                                "*.egg-info", "build", "dist")


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: Tuple[str, ...]


MUTATIONS: List[Mutation] = [
    Mutation("resume-never-loads-state", "mfqat/integrations/train_loop.py",
             "            acc.load_state(args.resume, **resume_kwargs(base, args.resume))", "            pass  # state not loaded",
             ("tests/test_train.py::test_resume_gives_the_uninterrupted_run",)),
    Mutation("hf-callback-evaluates-full-precision", "mfqat/integrations/hf.py",
             "            set_format(model, fmt)\n", "            set_format(model, None)\n",
             ("tests/test_train.py::test_hf_callback_eval_losses_are_the_formats_losses",)),
    Mutation("random-schedule-ignores-seed", "mfqat/qat/schedules.py",
             "return random.Random(self.seed * 1_000_003 + step).choice(self.formats)",
             "return random.Random(step).choice(self.formats)",
             ("tests/test_qat.py::test_random_schedule_follows_its_seed",)),
    Mutation("activation-fake-quant-off", "mfqat/qat/modules.py",
             "            x = fake_quantize(x, self.activation_format, self.block_size, self.scale_rule)\n",
             "            x = x\n",
             ("tests/test_qat.py::test_activation_fake_quant_equals_manual_qdq_of_inputs",)),
    Mutation("embedding-fake-quant-off", "mfqat/qat/modules.py",
             "out = F.embedding(ids, self.quantized_weight(), ", "out = F.embedding(ids, self.weight, ",
             ("tests/test_qat.py::test_embedding_fake_quant_equals_manual_qdq_of_table",)),
    Mutation("distill-kl-direction-swapped", "mfqat/integrations/train_loop.py",
             "alpha * token_kl(out.logits, teacher)", "alpha * token_kl(teacher, out.logits)",
             ("tests/test_train.py::test_distillation_loss_is_kl_teacher_to_student",)),
    Mutation("through-anchor-ignored", "mfqat/qat/modules.py",
             "        if self.anchor_format is None:\n            return self._qdq(w, fmt,",
             "        if True:\n            return self._qdq(w, fmt,",
             ("tests/test_joint.py::test_through_anchor_forward_equals_load_anchor",)),
    Mutation("recompute-backward-uses-current-format", "mfqat/qat/modules.py",
             "quantized_weight(ctx.fmt)", "quantized_weight()",
             ("tests/test_joint.py::test_joint_step_equals_weighted_sum_of_format_gradients",)),
    Mutation("triton-through-mask-drops-anchor-stage", "mfqat/quant/kernels/triton_mx.py",
             "(sat_a | sat).to(tl.int8)", "sat.to(tl.int8)",
             ("tests/test_through_kernel.py::test_through_bit_exact_adversarial[floor-ceil-mxint8-mxint4-triton-cpu]",)),
    Mutation("two-pass-through-mask-drops-anchor-stage", "mfqat/quant/kernels/__init__.py",
             "    return out, (m1 | m2 if need_mask else None)", "    return out, (m2 if need_mask else None)",
             ("tests/test_through_kernel.py::test_without_a_fused_op_the_dispatch_runs_two_passes",)),
    Mutation("joint-loss-weights-ignored", "mfqat/qat/joint.py",
             "            backward(loss * (weights[fmt] * scale))", "            backward(loss * scale)",
             ("tests/test_joint.py::test_joint_step_equals_weighted_sum_of_format_gradients",)),
    Mutation("sensitivity-never-lowers-the-tensor", "mfqat/export/sensitivity.py",
             "        param.data.copy_(probe_w.to(param.dtype))\n", "",
             ("tests/test_sensitivity.py",)),
    Mutation("anchor-state-drops-plain-tensors", "mfqat/eval/elastic.py",
             "    return anchor.state_dict(fmt, dtype)\n",
             "    return {k: q.dequantize(dtype) for k, q in anchor.in_format(fmt).items()}\n",
             ("tests/test_elastic_eval.py",)),
    Mutation("nf4-ties-to-upper-entry", "mfqat/quant/reference_bnb.py",
             "codes = torch.bucketize(y, mids, right=False)", "codes = torch.bucketize(y, mids, right=True)",
             ("tests/test_reference.py::test_nf4_exact_ties_go_to_the_lower_entry",
              "tests/test_crosscheck.py::test_bitsandbytes_nf4_exact_ties")),
    Mutation("reference-scale-clamp-off-by-one", "mfqat/quant/reference.py",
             "    s = s.clamp(-127, 127)\n    return s, nonfinite", "    s = s.clamp(-126, 127)\n    return s, nonfinite",
             ("tests/test_reference.py::test_extreme_exponents[mxint8-reference]",)),
    Mutation("triton-scale-clamp-off-by-one", "mfqat/quant/kernels/triton_mx.py",
             "        s = tl.minimum(tl.maximum(s, -127), 127)\n", "        s = tl.minimum(tl.maximum(s, -126), 127)\n",
             ("tests/test_reference.py::test_extreme_exponents[mxint8-triton]",)),
    Mutation("export-drops-rope-theta", "mfqat/models/family.py",
             '        cfg.setdefault("rope_theta", rope["rope_theta"])\n', "        pass\n",
             ("tests/test_export_exact.py::test_export_matches_independent_reference[int-mxint4]",)),
    Mutation("grad-compress-error-feedback-dropped", "mfqat/integrations/grad_compress.py",
             "        grad = grad + _bucket_residual(", "        grad = grad + 0 * _bucket_residual(",
             ("tests/test_grad_compress.py::test_compressed_loss_tracks_fp32_and_error_feedback_helps",)),
    Mutation("grad-compress-ranks-decode-own-gradient", "mfqat/integrations/grad_compress.py",
             "        total = decode(gathered[0], buf.numel(), state.fmt)",
             "        total = grad.clone() if dist.get_rank() == 0 else decode(gathered[0], buf.numel(), state.fmt)",
             ("tests/test_grad_compress.py::test_ranks_stay_bit_identical",)),
    Mutation("fsdp-reduces-every-backward", "mfqat/integrations/fsdp.py",
             "    if isinstance(model, FSDPModule) and self_sharded(acc):", "    if False:",
             ("tests/test_fsdp.py::test_train_with_the_fsdp_config_shards_and_saves_the_ddp_anchor",)),
    Mutation("scale-search-importance-from-lowered-model", "mfqat/anchor/search.py",
             "model = anchor_model(anchor, device=calib.device)",
             "model = anchor_model(anchor, wanted[-1], device=calib.device)",
             ("tests/test_anchor_search.py::test_calibrated_load_is_the_weighted_search_of_each_block",)),
    Mutation("scale-search-marks-mxfp-too", "mfqat/anchor/search.py",
             "            and FORMATS[n].family == a.family and FORMATS[n].bits < a.bits]",
             "            and FORMATS[n].bits < a.bits] + ([\"mxfp4_e2m1\"] if a.family == \"mxfp\" else [])",
             ("tests/test_anchor_search.py::test_formats_the_search_does_not_serve_keep_their_rule_and_say_so",)),
    Mutation("train-search-importance-from-every-format", "mfqat/qat/modules.py",
             "and self.fmt == self.anchor_format and self.tracks_importance",
             "and self.tracks_importance",
             ("tests/test_train_search.py::test_importance_is_the_mean_squared_input_of_anchor_format_training_forwards",)),
    Mutation("train-search-anchor-without-importance", "mfqat/anchor/checkpoint.py",
             'tensors.update({f"{k}.importance": v for k, v in recorded_importance(model, entries, recorded).items()})',
             "pass",
             ("tests/test_train_search.py::test_trained_search_model_equals_its_loaded_anchor_bit_for_bit",)),
    Mutation("train-search-stale-exponents", "mfqat/qat/modules.py",
             "key = (wkey, w.dtype, w.device, tuple(w.shape), self.importance_tokens)",
             "key = (w.data_ptr(),)",
             ("tests/test_train_search.py::test_the_kept_exponents_follow_the_weight_and_the_importance",)),
    Mutation("train-search-ranks-not-summed", "mfqat/qat/importance_state.py",
             "    torch.distributed.all_reduce(flat)", "    pass",
             ("tests/test_importance_sync.py::test_ddp_ranks_search_with_the_same_summed_importance",)),
    Mutation("train-search-trainer-resume-restarts", "mfqat/integrations/hf.py",
             "        if not importance_state.load_state(model, ckpt, args.process_index):", "        if False:",
             ("tests/test_importance_sync.py::test_trainer_resume_keeps_the_importance_statistic",)),
    Mutation("train-search-blind-to-fused-steps", "mfqat/qat/modules.py",
             "register_optimizer_step_post_hook(_count_optimizer_step)\n", "\n",
             ("tests/test_train_search.py::test_a_fused_optimizer_step_refreshes_the_kept_exponents",)),
    Mutation("train-search-one-cached-format", "mfqat/qat/modules.py",
             "self._search_cache[fmt] = (key, exps)", "self._search_cache = {fmt: (key, exps)}",
             ("tests/test_train_search.py::test_each_format_keeps_its_exponents_and_non_finite_inputs_are_left_out",)),
    Mutation("train-search-records-non-finite", "mfqat/qat/modules.py",
             "                              \"the search rule's importance statistic\")\n                return\n",
             "                              \"the search rule's importance statistic\")\n",
             ("tests/test_train_search.py::test_each_format_keeps_its_exponents_and_non_finite_inputs_are_left_out",)),
    Mutation("train-search-new-rank-restarts", "mfqat/qat/importance_state.py",
             "        path = state_file(folder, 0)\n        if not path.is_file():", "        if True:",
             ("tests/test_importance_sync.py::test_checkpointed_importance_keeps_pending_records_and_a_new_rank_takes_rank0s",)),
    Mutation("train-search-missing-ddp-sync-silent", "mfqat/qat/modules.py",
             "self._pending_since < _OPTIMIZER_STEPS[0]", "self._pending_since > _OPTIMIZER_STEPS[0]",
             ("tests/test_importance_sync.py::test_ddp_without_sync_warns_that_the_importance_is_stale",)),
    Mutation("train-search-fallback-skips-the-anchor", "mfqat/quant/scale_search.py",
             "return dequantize_with_exponents(fake_quantize(x.detach(), a, block_size, anchor_rule), f, block_size,",
             "return dequantize_with_exponents(x.detach(), f, block_size,",
             ("tests/test_search_kernel.py::test_searched_weight_uses_the_fused_op_with_the_same_bits",)),
    Mutation("train-search-fused-anchor-rule-ignored", "mfqat/quant/kernels/__init__.py",
             "return cpp.decode_exponents_through_cpp(x, anchor, anchor_rule, fmt, block_size, *exponents)",
             "return cpp.decode_exponents_through_cpp(x, anchor, \"ceil\", fmt, block_size, *exponents)",
             ("tests/test_search_kernel.py::test_searched_weight_uses_the_fused_op_with_the_same_bits",)),
    Mutation("train-search-fallback-searches-the-master", "mfqat/quant/scale_search.py",
             "    base = fake_quantize(x.detach(), a, block_size, anchor_rule)\n    exps = search_exponents(base,",
             "    base = x.detach()\n    exps = search_exponents(base,",
             ("tests/test_search_kernel.py::test_searched_format_search_entry_point_is_the_same_fused_or_not",)),
    Mutation("ptq-state-ignores-the-rule", "mfqat/eval/elastic.py",
             "quantize(sd[k].float(), fmt, block_size, scale_rule)", "quantize(sd[k].float(), fmt, block_size)",
             ("tests/test_scale_rules.py::test_a_single_format_model_is_evaluated_with_the_rule_it_trained_with",)),
    Mutation("ptq-state-defaults-to-floor", "mfqat/eval/elastic.py",
             'DEFAULT_SCALE_RULE.get(get_format(fmt).name, "floor") if get_format(fmt).is_mx else "floor"', '"floor"',
             ("tests/test_scale_rules.py::test_a_single_format_model_is_evaluated_with_the_rule_it_trained_with",)),
    Mutation("mxfp-search-through-the-master", "mfqat/qat/modules.py",
             "        if rule_of(rules, fmt) == SEARCH_RULE and fmt != self.anchor_format:",
             "        if rule_of(rules, fmt) == SEARCH_RULE and fmt != self.anchor_format and 'mxint' in fmt:",
             ("tests/test_train_search.py::test_mxfp_search_trained_model_equals_its_loaded_anchor_and_beats_its_rule",)),
    Mutation("calib-ignores-the-trained-mxfp-search", "mfqat/anchor/search.py",
             "    trained = [n for n, r in (recorded or {}).items() if r == SEARCH_RULE and n != anchor_fmt]",
             "    trained = []",
             ("tests/test_train_search.py::test_calibrating_an_mxfp_searched_anchor_replaces_its_importance",)),
    Mutation("shared-importance-ignores-in-place-edits", "mfqat/qat/input_squares.py",
             "last[0]() is x and x._version == last[1]", "last[0]() is x",
             ("tests/test_train_search.py::test_an_input_summed_once_is_reused_only_while_it_is_the_same_unmodified_tensor",)),
    Mutation("shared-importance-keyed-on-shape", "mfqat/qat/input_squares.py",
             "last[0]() is x and", "last[0]() is not None and last[0]().shape == x.shape and",
             ("tests/test_train_search.py::test_importance_is_the_mean_squared_input_of_anchor_format_training_forwards",)),
    Mutation("mlx-resume-skips-optimizer-state", "mfqat/mlx/runtime.py",
             "    opt.state = tree_unflatten(", "    _ = tree_unflatten(",
             ("tests/test_mlx_train.py::test_resumed_run_gives_the_uninterrupted_losses_and_anchor",)),
    Mutation("layer-upward-import", "mfqat/quant/slice.py",
             "from mfqat.quant.mxtensor import MXTensor\n",
             "from mfqat.quant.mxtensor import MXTensor\nfrom mfqat.export.storage import stored_bits  # noqa: F401\n",
             ("tests/test_layers.py::test_imports_only_go_down",)),
    Mutation("layer-import-cycle", "mfqat/storage/guard.py",
             "import contextlib\n", "import contextlib\nimport mfqat.storage.io  # noqa: F401\n",
             ("tests/test_layers.py::test_no_cycle_in_the_package",)),
    # model families (mfqat/models, fused MoE experts)
    Mutation("experts-forward-unquantized", "mfqat/qat/experts.py",
             "cache[name] = weights[name].quantized_weight()", "cache[name] = weights[name].weight",
             ("tests/test_families.py::test_family_end_to_end[qwen3_moe]",)),
    Mutation("expert-split-order-swapped", "mfqat/models/family.py",
             "for i, piece in enumerate(rule.mlx)]", "for i, piece in enumerate(reversed(rule.mlx))]",
             ("tests/test_families.py::test_moe_export_splits_experts_code_for_code[qwen3_moe]",)),
    Mutation("router-quantized-at-export", "mfqat/export/recipes.py",
             "            and not family.kept_high(k)]\n", "            ]\n",
             ("tests/test_families.py::test_family_end_to_end[mixtral]",)),
    Mutation("mlx-config-drops-num-experts", "mfqat/models/qwen3_moe.py",
             '        cfg["num_experts"] = cfg["num_local_experts"]\n', "        pass\n",
             ("tests/test_families.py::test_family_end_to_end[qwen3_moe]",)),
    Mutation("awq-gemma-norm-fold-ignores-1-plus-w", "mfqat/export/awq.py",
             "    offset = 0.0 if isinstance(producer, nn.Linear) else norm_offset\n", "    offset = 0.0\n",
             ("tests/test_families.py::test_awq_keeps_the_full_precision_function[gemma3_text]",)),
    # issue 36
    Mutation("resume-skips-steps-not-micro-batches", "mfqat/integrations/train_loop.py",
             "    for _ in range(start * args.grad_accum):", "    for _ in range(start):",
             ("tests/test_semantics_train.py::test_resume_with_grad_accum_continues_at_the_step_and_micro_batch",)),
    Mutation("grad-accum-loss-not-divided", "mfqat/integrations/train_loop.py",
             "    scale = 1.0 / args.grad_accum\n", "    scale = 1.0\n",
             ("tests/test_semantics_train.py::test_k_micro_batches_accumulate_the_gradient_of_one_k_times_larger_batch",)),
    Mutation("joint-step-drops-grad-accum-scale", "mfqat/qat/joint.py",
             "            backward(loss * (weights[fmt] * scale))", "            backward(loss * weights[fmt])",
             ("tests/test_semantics_train.py::test_k_micro_batches_accumulate_the_gradient_of_one_k_times_larger_batch",)),
    Mutation("trainer-distills-from-previous-format", "mfqat/integrations/hf.py",
             "keep=alpha > 0 and i == 0)", "keep=alpha > 0)",
             ("tests/test_semantics_train.py::test_mfqat_trainer_joint_step_is_the_written_out_distillation_loss",)),
    Mutation("trainer-joint-weights-ignored", "mfqat/integrations/hf.py",
             '        loss = loss * st["weight"]\n', "",
             ("tests/test_semantics_train.py::test_mfqat_trainer_joint_step_is_the_written_out_distillation_loss",)),
    Mutation("resume-accepts-foreign-checkpoint", "mfqat/integrations/train_args.py",
             "for k in RUN_KEYS if k in saved and saved[k] != now[k]]", "for k in RUN_KEYS if False]",
             ("tests/test_semantics_train.py::test_resume_from_a_missing_or_foreign_folder_fails_before_any_work",)),
    Mutation("resume-checked-after-the-model-loads", "mfqat/integrations/train_loop.py",
             "    check_resume(args)\n", "    pass\n",
             ("tests/test_semantics_train.py::test_resume_from_a_missing_or_foreign_folder_fails_before_any_work",)),
    Mutation("mlx-adamw-without-bias-correction", "mfqat/mlx/train.py",
             "bias_correction=True)", "bias_correction=False)",
             ("tests/test_semantics_train.py::test_mlx_train_adamw_matches_torch_adamw_step_for_step",)),
    Mutation("mx-qlora-joint-sums-the-losses", "mfqat/qlora/train.py",
             "labels=batch).loss / len(fmts)", "labels=batch).loss",
             ("tests/test_semantics_train.py::test_mx_qlora_joint_loss_is_the_mean_of_the_formats_losses",)),
    Mutation("nf4-base-without-double-quant", "mfqat/integrations/lora.py",
             "bnb_4bit_use_double_quant=True", "bnb_4bit_use_double_quant=False",
             ("tests/test_semantics_train.py::test_bnb_nf4_base_is_double_quantized_at_4_127_bits",)),
    Mutation("imatrix-negative-accepted", "mfqat/export/imatrix.py",
             "if not torch.isfinite(table[key]).all() or (table[key] < 0).any():",
             "if not torch.isfinite(table[key]).all():",
             ("tests/test_semantics_export.py::test_imatrix_with_negative_nan_or_wrong_width_is_refused_naming_the_layer",)),
    Mutation("anchor-importance-sign-unchecked", "mfqat/anchor/meta.py",
             "if not torch.isfinite(imp).all() or (imp < 0).any():", "if not torch.isfinite(imp).all():",
             ("tests/test_semantics_export.py::test_stored_importance_that_is_not_a_mean_square_is_refused_naming_the_tensor",)),
    Mutation("anchor-version-check-off-by-one", "mfqat/anchor/meta.py",
             "and v > ANCHOR_FORMAT_VERSION:", "and v > ANCHOR_FORMAT_VERSION + 1:",
             ("tests/test_semantics_export.py::test_an_anchor_one_version_newer_is_refused_naming_it_and_older_ones_load",)),
    Mutation("auto-allocation-skips-the-top-width", "mfqat/export/sensitivity.py",
             "        for j, f in enumerate(levels):\n", "        for j, f in enumerate(levels[:-1]):\n",
             ("tests/test_semantics_export.py::test_auto_allocation_is_the_brute_force_optimum_and_leaves_no_width_unconsidered",)),
    Mutation("auto-allocation-greedy-only", "mfqat/export/sensitivity.py",
             "    if exact is not None:\n        return exact\n", "",
             ("tests/test_semantics_export.py::test_auto_allocation_is_the_brute_force_optimum_and_leaves_no_width_unconsidered",)),
    Mutation("export-report-group-of-the-anchor", "mfqat/export/mlx_export.py",
             '"group_size": plan.group_of(plan.formats[name]),', '"group_size": plan.group_size,',
             ("tests/test_semantics_export.py::test_export_report_group_size_and_bits_are_those_on_disk",)),
    Mutation("export-report-bits-of-the-format", "mfqat/export/mlx_export.py",
             '"bits": st.bits,', '"bits": get_format(plan.formats[name]).bits,',
             ("tests/test_semantics_export.py::test_export_report_group_size_and_bits_are_those_on_disk",)),
    Mutation("export-check-tolerates-rounding", "mfqat/export/verify.py",
             "if got.shape != expect.shape or not np.array_equal(got, expect):",
             "if got.shape != expect.shape or not np.allclose(got, expect):",
             ("tests/test_semantics_export.py::test_export_check_reports_one_flipped_code_or_a_scale_one_ulp_off",)),
    # issue 31: Qwen3-Next's plain tensors in mlx-lm's runtime form
    Mutation("qwen3-next-norms-written-without-plus-one", "mfqat/models/qwen3_next.py",
             "plain_rules=(NORMS, CONV_AXES)", "plain_rules=(CONV_AXES,)",
             ("tests/test_families.py::test_family_end_to_end[qwen3_next]",)),
    Mutation("export-check-reference-ignores-plain-rules", "mfqat/export/verify.py",
             "    written = family.mlx_value(name, value.float())\n", "    written = value.float()\n",
             ("tests/test_families.py::test_family_end_to_end[qwen3_next]",)),
    Mutation("gemma2-sliding-window-unreported", "mfqat/models/gemma2.py",
             "norm_offset=1.0, caveats=caveats,", "norm_offset=1.0,",
             ("tests/test_families.py::test_gemma2_export_says_where_mlx_lm_stops_matching",)),
    Mutation("fp8-source-not-dequantized-on-gpu", "mfqat/data/sources.py",
             'cls.from_dict({**fields, "dequantize": True})', "cls.from_dict({**fields})",
             ("tests/test_fp8_source.py::test_fp8_is_dequantized_on_every_device_and_never_claimed_by_the_anchor",)),
    Mutation("prequantized-source-loaded-as-is", "mfqat/data/sources.py",
             "    if method not in DEQUANTIZED_ON_LOAD:\n", "    if False:\n",
             ("tests/test_fp8_source.py::test_other_prequantized_checkpoints_are_refused_by_name",)),
    # issue 32: learned affine widths stored in the anchor (mfqat refine, format version 4)
    Mutation("anchor-ignores-its-refined-scales", "mfqat/anchor/checkpoint.py",
             "        return width.apply(name, q) if width is not None else q\n", "        return q\n",
             ("tests/test_anchor_refined.py::test_the_anchor_stores_each_width_it_learned_and_load_anchor_uses_it",
              "tests/test_anchor_refined.py::test_an_export_of_a_refined_width_ships_the_stored_scales_bit_exact")),
    Mutation("refined-scales-used-at-any-group", "mfqat/anchor/refined.py",
             "width is not None and width.group_size == group_size else None", "width is not None else None",
             ("tests/test_anchor_refined.py::test_the_anchor_stores_each_width_it_learned_and_load_anchor_uses_it",)),
    Mutation("refine-stores-values-learned-on-other-weights", "mfqat/anchor/refined_store.py",
             "        if learned_from is not None and meta[\"files\"] != learned_from:\n", "        if False:\n",
             ("tests/test_anchor_refined.py::test_values_learned_on_other_weights_are_refused",)),
    Mutation("refined-file-read-unverified", "mfqat/anchor/checkpoint.py",
             "snap.read_checked(name, manifest.get(name) if verify else None),\n", "snap.read_checked(name, None),\n",
             ("tests/test_anchor_refined.py::test_a_changed_refined_file_is_refused_by_name",)),
    Mutation("refined-file-outside-the-manifest-accepted", "mfqat/anchor/refined.py",
             "        if name not in manifest:\n", "        if False:\n",
             ("tests/test_anchor_refined.py::test_a_changed_refined_file_is_refused_by_name",)),
    # issue 32: affine scales learned with the weights (QATConfig.learn_scales)
    Mutation("learned-scales-never-applied", "mfqat/qat/learned_scales.py",
             "    return _rounded(q, *scales_biases(q, ac.detach()))\n",
             "    return _rounded(q, *scales_biases(q, 0 * ac.detach()))\n",
             ("tests/test_learned_scales.py::test_the_gradient_is_the_formula_and_the_value_is_mlx_dequantize",)),
    Mutation("learned-scales-gradient-without-codes", "mfqat/qat/learned_scales.py",
             "(codes * s.unsqueeze(-1) + b.unsqueeze(-1))", "(s.unsqueeze(-1) + b.unsqueeze(-1)).expand_as(codes)",
             ("tests/test_learned_scales.py::test_the_gradient_is_the_formula_and_the_value_is_mlx_dequantize",)),
    Mutation("learned-scales-stored-on-the-master-not-the-anchor", "mfqat/anchor/refined.py",
             "        values = quantize(state[name].float(), anchor, block_size, scale_rule).dequantize(torch.float32)\n",
             "        values = state[name].float()\n",
             ("tests/test_learned_scales.py::test_training_moves_the_scales_and_the_anchor_reproduces_every_width_bit_exact",)),
    Mutation("learned-scales-recomputed-without-their-gradient", "mfqat/qat/modules.py",
             "                and self.learned_scales_of(self.fmt) is None:", "                and True:",
             ("tests/test_learned_scales.py::test_training_moves_the_scales_and_the_anchor_reproduces_every_width_bit_exact",)),
    Mutation("trainer-scales-at-the-model-lr", "mfqat/integrations/hf.py",
             "        if built_here and learned and not any(g.get(\"mfqat_learned_scales\") for g in opt.param_groups):\n",
             "        if False:\n",
             ("tests/test_learned_scales.py::test_mfqat_trainer_gives_the_scales_their_own_learning_rate",)),
    Mutation("learned-scales-saved-in-the-master", "mfqat/integrations/train_setup.py",
             "    learned = [k for k in state if f\".{LEARNED_ATTR}.\" in f\".{k}\"]\n", "    learned = []\n",
             ("tests/test_learned_scales.py::test_the_master_folder_and_the_state_dict_stay_drop_in",)),
    Mutation("learned-scales-left-out-of-passes-ddp-fails", "mfqat/qat/modules.py",
             "        if scales is None or not torch.is_grad_enabled() or not isinstance(out, torch.Tensor):\n",
             "        if True:\n",
             ("tests/test_train.py::test_accelerate_ddp_two_ranks_same_weights[learned-scales]",)),
    Mutation("learned-scales-of-layers-outside-the-anchor-stored", "mfqat/anchor/checkpoint.py",
             "    learned = {k: v for k, v in learned.items() if k[0] in entries}", "    learned = dict(learned)",
             ("tests/test_learned_scales.py::test_an_anchor_of_some_layers_or_of_another_format_is_handled",)),
    Mutation("learned-scales-saved-on-another-anchor-format", "mfqat/anchor/checkpoint.py",
             "    if learned and trained_through != {f.name}:\n", "    if False:\n",
             ("tests/test_learned_scales.py::test_an_anchor_of_some_layers_or_of_another_format_is_handled",)),
    Mutation("trainer-rewrites-the-users-optimizer", "mfqat/integrations/hf.py",
             "        if built_here and learned and", "        if learned and",
             ("tests/test_learned_scales.py::test_an_optimizer_the_user_passes_is_left_as_given",)),
    Mutation("calibration-mix-read-as-plain-text", "mfqat/data/sources.py",
             "    if not isinstance(text, MixedText) or len(text.sources) < 2:\n", "    if True:\n",
             ("tests/test_calib_mix.py",)),
    Mutation("calibration-text-copied-into-the-manifest", "mfqat/export/refine.py",
             '"calibration": describe_calibration(calib_text)}', '"calibration": calib_text or "pydoc training split"}',
             ("tests/test_anchor_refined.py::test_the_refine_command_stores_a_width_and_prints_the_table",)),
    Mutation("generated-calibration-unseeded", "mfqat/data/generated.py",
             "        torch.manual_seed(seed)\n", "        pass\n",
             ("tests/test_calib_mix.py::test_the_generated_source_samples_the_model_reproducibly_and_mixes_by_blocks",)),
    Mutation("resume-ignores-learned-scales", "mfqat/integrations/train_args.py",
             '"base", "learn_scales")', '"base")',
             ("tests/test_semantics_train.py::test_resume_refuses_switching_learned_scales",)),
    # issue 34: the replayed sensitivity pass
    Mutation("sensitivity-replay-starts-a-layer-late", "mfqat/export/replay.py",
             "                return int(index)\n", "                return int(index) + 1\n",
             ("tests/test_sensitivity.py::test_replayed_pass_scores_equal_the_plain_pass",)),
    Mutation("sensitivity-replay-tied-embedding-from-the-head", "mfqat/export/replay.py",
             "min(layer_of(a) for a in aliases", "max(layer_of(a) for a in aliases",
             ("tests/test_sensitivity.py::test_replayed_pass_scores_equal_the_plain_pass",)),
    Mutation("sensitivity-replay-keeps-outputs-by-reference", "mfqat/export/replay.py",
             "self.outputs[i] = _copy(output)", "self.outputs[i] = output",
             ("tests/test_sensitivity.py::test_replay_from_every_layer_equals_the_full_forward_when_layers_write_in_place",)),
    Mutation("sensitivity-replay-hands-out-the-recorded-output", "mfqat/export/replay.py",
             "        return _copy(output)  # the recorded", "        return output  # the recorded",
             ("tests/test_sensitivity.py::test_replay_from_every_layer_equals_the_full_forward_when_layers_write_in_place",)),
    # issue 33
    Mutation("resume-trusts-an-unverified-checkpoint", "mfqat/integrations/train_loop.py",
             "resume_step = verify_checkpoint(args.resume, steps=args.steps) if args.resume else 0",
             "resume_step = json.loads((Path(args.resume) / 'mfqat_step.json').read_text())['step'] if args.resume else 0",
             ("tests/test_hostile_inputs.py::test_resume_refuses_truncated_foreign_and_unsealed_checkpoints",)),
    Mutation("checkpoint-accepts-custom-pickles", "mfqat/storage/train_checkpoint.py",
             "    if pickles:  # the digest", "    if False:  # the digest",
             ("tests/test_hostile_inputs.py::test_resume_never_unpickles_even_a_resealed_checkpoint",)),
    Mutation("resume-unpickling-error-is-a-traceback", "mfqat/integrations/train_loop.py",
             "        except pickle.UnpicklingError as e:", "        except ImportError as e:",
             ("tests/test_hostile_inputs.py::test_resume_never_unpickles_even_a_resealed_checkpoint",)),
    Mutation("checkpoint-manifest-ignores-extra-files", "mfqat/storage/train_checkpoint.py",
             "    if extra:\n        raise AnchorError", "    if False:\n        raise AnchorError",
             ("tests/test_hostile_inputs.py::test_resume_never_unpickles_a_planted_file", "tests/test_hostile_inputs.py::test_mlx_load_checkpoint_verifies_before_loading")),
    Mutation("mlx-resume-skips-verification", "mfqat/mlx/runtime.py",
             "    step = verify_checkpoint(folder, \"mlx_step.json\")\n",
             "    step = int(__import__(\"json\").loads(need[2].read_text())[\"step\"])\n",
             ("tests/test_hostile_inputs.py::test_mlx_load_checkpoint_verifies_before_loading",)),
    Mutation("save-every-skips-the-final-step", "mfqat/integrations/train_loop.py",
             "(step % args.save_every == 0 or step == args.steps)", "(step % args.save_every == 0 and step < args.steps)",
             ("tests/test_hostile_inputs.py::test_save_every_checkpoints_the_final_step",)),
    Mutation("mlx-save-every-skips-the-final-step", "mfqat/mlx/train.py",
             "(step % a.save_every == 0 or step == a.steps)", "(step % a.save_every == 0 and step < a.steps)",
             ("tests/test_hostile_inputs.py::test_mlx_save_every_checkpoints_the_final_step",)),
    Mutation("plain-trainer-runs-a-joint-recipe", "mfqat/integrations/hf.py",
             "            if len(several) > 1:", "            if False:",
             ("tests/test_hostile_inputs.py::test_plain_trainer_with_the_callback_refuses_a_joint_recipe",)),
    Mutation("anchor-of-no-quantized-tensor", "mfqat/anchor/checkpoint.py",
             "    if not entries:  # an anchor", "    if False:  # an anchor",
             ("tests/test_hostile_inputs.py::test_save_anchor_refuses_a_block_size_that_quantizes_no_tensor",)),
    Mutation("train-accepts-negative-steps", "mfqat/integrations/train_args.py",
             'TRAIN_MINIMUMS = {"steps": 1,', 'TRAIN_MINIMUMS = {"steps": -9,',
             ("tests/test_hostile_inputs.py::test_train_api_refuses_bad_numbers_too",)),
    Mutation("seq-len-one-accepted", "mfqat/integrations/train_args.py",
             '"seq_len": 2, "grad_accum"', '"seq_len": 1, "grad_accum"',
             ("tests/test_hostile_inputs.py::test_bad_numbers_are_one_line_exit_2_before_any_model_loads",)),
    Mutation("base-bits-unchecked", "mfqat/cli/checks.py",
             "            if not 2 <= a.base_bits <= 8:", "            if False:",
             ("tests/test_hostile_inputs.py::test_bad_numbers_are_one_line_exit_2_before_any_model_loads",)),
    Mutation("recipe-mixing-families-per-layer-accepted", "mfqat/qat/config.py",
             "        if per_layer and len(families | per_layer) > 1:", "        if False:",
             ("tests/test_hostile_inputs.py::test_a_recipe_mixing_families_per_layer_is_refused",)),
    Mutation("eval-plot-silently-overwritten", "mfqat/cli/checks.py",
             "        if Path(a.plot).exists() and not a.overwrite:", "        if False:",
             ("tests/test_hostile_inputs.py::test_eval_plot_and_mlx_train_outputs_are_not_silently_overwritten",)),
    Mutation("mlx-train-outputs-silently-overwritten", "mfqat/mlx/train.py",
             "    if found and not a.overwrite:", "    if False:",
             ("tests/test_hostile_inputs.py::test_eval_plot_and_mlx_train_outputs_are_not_silently_overwritten",)),
    Mutation("bench-looks-for-scripts-inside-the-package", "mfqat/cli/app.py",
             "script = Path(__file__).resolve().parents[2]", "script = Path(__file__).resolve().parents[1]",
             ("tests/test_hostile_inputs.py::test_bench_runs_from_a_checkout",)),
    # issue 32: nvfp4
    Mutation("nvfp4-reciprocal-not-division", "mfqat/quant/nvfp4.py",
             "    y = blocks / s\n", "    y = blocks * (1.0 / s)\n",
             ("tests/test_nvfp4.py::test_torchao_nvfp4_equals_ours_where_its_scale_is_normal_and_differs_only_at_exact_ties",)),
    Mutation("nvfp4-nonfinite-block-finite-scale", "mfqat/quant/nvfp4.py",
             "    return codes, torch.where(nonfinite, torch.full_like(byte, E4M3_NAN), byte), saturated & ~zero",
             "    return codes, byte, saturated & ~zero",
             ("tests/test_nvfp4.py::test_scale_rounding_saturation_subnormals_and_nonfinite_blocks",)),
    Mutation("nvfp4-scale-clamped-to-normal", "mfqat/quant/nvfp4.py",
             "    sb = torch.where(nonfinite, torch.zeros_like(amax), amax) / 6.0\n",
             "    sb = (torch.where(nonfinite, torch.zeros_like(amax), amax) / 6.0).clamp(min=2 ** -6)\n",
             ("tests/test_nvfp4.py::test_scale_rounding_saturation_subnormals_and_nonfinite_blocks",)),
    Mutation("nvfp4-mlx-rule-global-product-in-dtype", "mfqat/quant/nvfp4.py",
             "    y = (x / e4m3_decode(byte).to(dtype).unsqueeze(-1)).float()  # in dtype",
             "    y = x / e4m3_decode(byte).to(dtype).unsqueeze(-1)",
             ("tests/test_nvfp4.py::test_mlx_rule_is_mx_quantize_and_dequantize_is_mx_dequantize",)),
    Mutation("nvfp4-global-scale-applied-last", "mfqat/quant/nvfp4.py",
             "    if dec is not None:\n        s = s * dec\n    return mx_codes_to_values(codes, E2M1) * s.unsqueeze(-1)",
             "    v = mx_codes_to_values(codes, E2M1) * s.unsqueeze(-1)\n    return v if dec is None else v * dec",
             ("tests/test_nvfp4.py::test_mlx_rule_is_mx_quantize_and_dequantize_is_mx_dequantize",)),
    Mutation("nvfp4-trains-mxfp4-not-nvfp4", "mfqat/quant/derive.py",
             "        return fake_quantize(w.to(torch.float32), fmt, NVFP4_BLOCK).to(w.dtype)",
             '        return fake_quantize(w.to(torch.float32), "mxfp4_e2m1", NVFP4_BLOCK).to(w.dtype)',
             ("tests/test_nvfp4.py::test_training_forward_equals_the_anchors_nvfp4_weights",)),
    Mutation("nvfp4-export-scale-bytes-off-by-one", "mfqat/export/mlx_export.py",
             'q.scales.numpy(), None, "nvfp4", 4, True)', '(q.scales ^ 1).numpy(), None, "nvfp4", 4, True)',
             ("tests/test_nvfp4.py::test_export_mlx_uniform_nvfp4_is_code_for_code",)),
    Mutation("export-version-never-checked", "mfqat/export/verify.py",
             "    if v > EXPORT_FORMAT_VERSION:\n", "    if False:\n",
             ("tests/test_semantics_export.py::test_an_export_one_version_newer_is_refused_naming_it_and_older_ones_verify",)),
    Mutation("dynamic2-quantizes-attention-outputs", "mfqat/export/recipes.py",
             "    if re.search(ATTENTION_OUTPUTS, name):\n        return None\n",
             "    if re.search(ATTENTION_OUTPUTS, name):\n        return base\n",
             ("tests/test_families.py::test_dynamic2_recipe_on_qwen3_5[dynamic2]",)),
    Mutation("refine-learned-scales-never-written", "mfqat/export/recipes.py",
             "self.refined[name] if name in self.refined else ", "",
             ("tests/test_refine.py::test_refine_keeps_every_code_and_byte_and_moves_the_scales",)),
    Mutation("refine-keeps-a-worse-result", "mfqat/export/refine.py",
             "    kept = after < before\n", "    kept = True\n",
             ("tests/test_refine.py::test_a_refine_that_raises_the_kl_is_not_kept",)),
    Mutation("lora-default-targets-llama-only", "mfqat/integrations/train_args.py",
             'LORA_TARGETS = "all-linear"', 'LORA_TARGETS = LLAMA_LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"',
             ("tests/test_lora_families.py::test_default_lora_targets_adapt_every_familys_linears[phi3]",)),
    Mutation("mx-qlora-all-linear-ignored", "mfqat/qlora/model.py",
             'targets == ["all-linear"] or ', "",
             ("tests/test_lora_families.py::test_mx_qlora_default_targets_adapt_every_quantized_linear[phi3]",)),
    Mutation("hf-quantizer-reports-importance-as-unexpected", "mfqat/integrations/hf_quantizer.py",
             ', r"\\.importance$"}', "}",
             ("tests/test_lora_families.py::test_from_pretrained_of_a_family_anchor_is_load_anchor[qwen3_moe]",)),
    Mutation("calib-mix-ignores-weights", "mfqat/data/mix.py",
             "max(1, int(chunk * w / top))", "chunk",
             ("tests/test_calib_mix.py::test_the_mix_is_in_proportion_from_its_first_characters_and_keeps_everything",)),
    Mutation("calib-mix-pydoc-includes-held-out", "mfqat/data/mix.py",
             "        return split_text(load_text(None))[0]\n", "        return load_text(None)\n",
             ("tests/test_calib_mix.py::test_one_source_is_read_as_before_and_pydoc_is_its_training_split",)),
    Mutation("refine-codes-relearnt", "mfqat/export/refine.py",
             "        return MXTensor(q.codes, s,", "        return MXTensor(q.codes.flip(-1), s,",
             ("tests/test_refine.py::test_refine_keeps_every_code_and_byte_and_moves_the_scales",)),
    # A type error in a Triton kernel (float mantissa into bit operations): the compiler rejects it.
    Mutation("triton-aot-mantissa-left-float", "mfqat/quant/kernels/triton_mx.py",
             "        mant = (a * _exp2i_normal(MBITS - e)).to(tl.int32)\n",
             "        mant = a * _exp2i_normal(MBITS - e)\n",
             ("tests/test_triton_aot.py::test_kernel_compiles_without_spills[_quantize_kernel[mxfp4_e2m1-fp32-bs32-ceil]-sm_90]",)),
    # A kernel reading a plain Python global: TRITON_INTERPRET=1 runs it (same value, the interpreted
    # bit-exactness tests pass), the compiler refuses it, so only the AOT test can catch it without a GPU.
    Mutation("triton-aot-kernel-reads-python-global", "mfqat/quant/kernels/triton_mx.py",
             "        r = (t + 12582912.0) - 12582912.0\n", "        r = (t + ROUND_MAGIC) - ROUND_MAGIC\n",
             ("tests/test_triton_aot.py::test_kernel_compiles_without_spills[_fake_quant_kernel[mxint4-fp32-bs32-ceil-mask]-sm_80]",)),
    Mutation("export-seals-files-the-anchor-manifest-lacks", "mfqat/export/mlx_export.py",
             'manifest = meta.get("manifest") if not explicit else None', "manifest = None",
             ("tests/test_safety_export.py::test_files_the_anchor_manifest_lacks_are_not_sealed_into_the_export",
              "tests/test_safety_write.py::test_convert_leaves_out_files_the_anchor_manifest_lacks")),
    Mutation("token-blocks-tokenizes-the-whole-text", "mfqat/data/sources.py",
             "    for piece in text_pieces(text, TOKENIZE_CHARS) if exact else [text]:\n", "    for piece in [text]:\n",
             ("tests/test_text_reader.py::test_one_huge_line_is_tokenized_in_bounded_memory",)),
    Mutation("token-blocks-reads-past-max-blocks", "mfqat/data/sources.py",
             "        if need is not None and have >= need:\n", "        if False:\n",
             ("tests/test_text_reader.py::test_only_the_pieces_max_blocks_need_are_tokenized",)),
    Mutation("text-pieces-cut-after-whitespace", "mfqat/data/sources.py",
             "        while cut != -1 and text[cut - 1].isspace():\n", "        while False:\n",
             ("tests/test_text_reader.py::test_text_pieces_cut_before_a_space_after_a_non_space_and_keep_every_character",)),
    Mutation("embedded-model-called-full-precision", "mfqat/data/sources.py",
             'return f"embedded model ({EMBEDDED_MODEL})" if name in (None, "", DEFAULT_MODEL) else "full precision"',
             'return "full precision"',
             ("tests/test_demo.py::test_the_embedded_model_is_named_for_what_it_is",)),
    Mutation("version-claims-the-cpp-kernels-are-built", "mfqat/cli/backends.py",
             '    so = _spec_origin("mfqat._C")\n', '    so = "mfqat/_C.so"\n',
             ("tests/test_packaging.py::test_version_names_the_active_backends",)),
    # issue 34: the CUDA C++ op (csrc/cuda/), checked without a GPU
    # a type error in the kernels (a pointer shuffled): only nvcc sees the .cu
    Mutation("cuda-kernel-shuffles-a-pointer", "csrc/cuda/mx_kernels.cu",
             "__shfl_xor_sync(0xffffffffu, v, off)", "__shfl_xor_sync(0xffffffffu, &v, off)",
             ("tests/test_cuda_op.py::test_nvcc_compiles_every_kernel_for_the_target_without_spills[sm_90]",)),
    # a type error in the torch binding (a tensor where the launcher takes a pointer)
    Mutation("cuda-binding-passes-a-tensor-as-pointer", "csrc/cuda/mx_cuda_ops.cpp",
             "launch_fake_quant(dtype_code(x), x.const_data_ptr(),", "launch_fake_quant(dtype_code(x), x,",
             ("tests/test_cuda_op.py::test_the_torch_binding_compiles_against_torch_and_cuda_headers",)),
    # float32 -> float16 ties rounded up, not to even (MX outputs are exact in float16, so only the
    # conversion sweep sees it)
    Mutation("cuda-math-half-ties-round-up", "csrc/cuda/mx_block.cuh",
             "(rem > 0x1000u || (rem == 0x1000u && (h & 1u)))", "(rem >= 0x1000u)",
             ("tests/test_cuda_op.py::test_float16_and_bfloat16_conversions_are_torchs",)),
    # MXFP elements below the format's smallest normal rounded on a finer grid than its subnormals
    Mutation("cuda-math-fp-element-exponent-not-clamped", "csrc/cuda/mx_block.cuh",
             "  e = e < p.emin ? p.emin : e;  // e in [emin, emax + 1]", "  // e in [emin, emax + 1]",
             ("tests/test_cuda_op.py::test_host_fake_quant_bit_exact_adversarial[floor-mxfp4_e2m1]",)),
    # the block maximum not reduced over the warp: each lane scales by its own element (the serial host
    # run cannot see it; the 32 emulated lanes do)
    Mutation("cuda-block-max-not-reduced-over-the-warp", "csrc/cuda/mx_block.cuh",
             "  m = lanes.reduce_max(m);\n  bool nonfinite;\n", "  bool nonfinite;\n",
             ("tests/test_cuda_op.py::test_host_as_32_lanes_of_a_warp_is_bit_exact[32]",)),
    Mutation("cuda-backend-runs-the-reference", "mfqat/quant/kernels/__init__.py",
             'if backend in ("cpp", "cuda"):  # one torch op', 'if backend == "cpp":  # one torch op',
             ("tests/test_cuda_op.py::test_forced_cuda_backend_runs_the_op_and_says_why_it_cannot",)),
    # fast math for speed: flush-to-zero and approximate division on the device only
    Mutation("setup-nvcc-fast-math", "setup.py",
             'NVCC_FLAGS = ["-O3", "--fmad=false", "-std=c++17"]', 'NVCC_FLAGS = ["-O3", "--use_fast_math", "-std=c++17"]',
             ("tests/test_cuda_op.py::test_device_code_has_no_fused_multiply_add_and_keeps_subnormals",)),
    Mutation("setup-never-builds-the-cuda-op", "setup.py",
             "if cuda_home is not None and all(", "if False and all(",
             ("tests/test_cuda_op.py::test_setup_builds_the_cuda_op_only_with_a_cuda_torch_and_nvcc",)),
    Mutation("setup-cuda-failure-drops-the-cpu-kernels", "setup.py",
             "            if cpu_sources is not None:  # the CUDA op failed", "            if False:  # the CUDA op failed",
             ("tests/test_cuda_op.py::test_a_failed_cuda_build_falls_back_to_the_cpu_kernels",)),
    Mutation("version-never-says-the-cuda-op-is-built", "mfqat/cli/backends.py",
             "            return CUDA_OP_MARK in f.read()", "            return False",
             ("tests/test_cuda_op.py::test_version_says_whether_the_cuda_op_is_built",)),
    # issue 34: scripts/gpu_check.sh, kept runnable without a GPU
    Mutation("gpu-check-train-flag-misspelt", "scripts/gpu_check.sh",
             '--device "$DEVICE" --dtype bfloat16 "${TRAIN[@]}"', '--device "$DEVICE" --dtpye bfloat16 "${TRAIN[@]}"',
             ("tests/test_gpu_check.py::test_smoke_run_runs_every_stage_on_cpu",)),
    Mutation("gpu-check-budget-ignored", "scripts/gpu_check.sh",
             '  if [ "$left" -lt 15 ]; then', '  if false; then',
             ("tests/test_gpu_check.py::test_the_budget_stops_starting_stages",)),
    Mutation("gpu-check-stage-limit-not-cut", "scripts/gpu_check.sh",
             '  [ "$limit" -gt "$left" ] && limit=$left\n', "",
             ("tests/test_gpu_check.py::test_the_budget_stops_starting_stages",)),
    Mutation("gpu-summary-bandwidth-per-format-not-backend", "scripts/gpu_summary.py",
             "per.setdefault(m.group(2), [])", "per.setdefault(m.group(1), [])",
             ("tests/test_gpu_check.py::test_summary_pulls_each_stages_numbers",)),
    # issue 33 (the remaining items)
    Mutation("nf4-resume-loads-strictly", "mfqat/integrations/lora.py",
             '    return {"strict": False}\n', '    return {}\n',
             ("tests/test_qlora.py::test_nf4_qlora_resume_gives_the_uninterrupted_run",)),
    Mutation("nf4-resume-skips-the-key-check", "mfqat/integrations/lora.py",
             "        if missing:\n            raise", "        if False:\n            raise",
             ("tests/test_qlora.py::test_nf4_resume_refuses_a_checkpoint_lacking_a_tensor",)),
    Mutation("convert-output-checked-after-the-work", "mfqat/cli/checks.py",
             '        need_output(a.out, a.overwrite, "convert" if cmd == "convert" else "mlx-export", [a.anchor])\n', "",
             ("tests/test_hostile_inputs.py::test_convert_and_export_check_their_output_before_the_work",)),
    Mutation("output-under-a-file-not-checked", "mfqat/cli/checks.py",
             "    if not parent.is_dir():\n        raise UsageError", "    if False:\n        raise UsageError",
             ("tests/test_hostile_inputs.py::test_convert_and_export_check_their_output_before_the_work",)),
    Mutation("missing-embedded-model-is-a-traceback", "mfqat/data/sources.py",
             "class EmbeddedModelMissing(FileNotFoundError):", "class EmbeddedModelMissing(RuntimeError):",
             ("tests/test_hostile_inputs.py::test_a_missing_embedded_model_package_is_one_line_saying_how_to_install_it",)),
    Mutation("disk-full-says-nothing-of-the-output", "mfqat/storage/io.py",
             "                raise disk_full(dest, e) from e\n", "                raise\n",
             ("tests/test_hostile_inputs.py::test_a_full_disk_while_saving_an_anchor_leaves_the_previous_one_intact",
              "tests/test_hostile_inputs.py::test_a_full_disk_during_convert_is_one_line_and_keeps_the_previous_output")),
    Mutation("single-file-write-leaves-its-temp-file", "mfqat/storage/io.py",
             "        Path(tmp).unlink(missing_ok=True)\n        if isinstance(e, OSError) and e.errno in DISK_FULL:",
             "        if isinstance(e, OSError) and e.errno in DISK_FULL:",
             ("tests/test_hostile_inputs.py::test_a_full_disk_in_a_single_file_write_keeps_the_old_file_and_leaves_no_temp",)),
    Mutation("disk-full-leaves-the-partial-copy", "mfqat/storage/io.py",
             "        except BaseException as e:\n            shutil.rmtree(tmp, ignore_errors=True)\n",
             "        except BaseException as e:\n            pass\n",
             ("tests/test_hostile_inputs.py::test_a_full_disk_while_saving_an_anchor_leaves_the_previous_one_intact",)),
    Mutation("tiny-anchor-saved-without-tokenizer", "mfqat/integrations/train_loop.py",
             "    tok = tok if tok is not None else byte_tokenizer()", "    tok = tok",
             ("tests/test_hostile_inputs.py::test_a_tiny_runs_anchors_carry_the_tokenizer_its_data_used",
              "tests/test_hostile_inputs.py::test_a_tiny_runs_anchor_exports_to_mlx_without_a_tokenizer_flag")),
    Mutation("lora-qat-eval-runs-the-unmerged-model", "mfqat/integrations/train_loop.py",
             '                set_format(saved, f)\n                ppl = perplexity(saved, held, desc=f"eval {f}")',
             '                set_format(base, f)\n                ppl = perplexity(base, held, desc=f"eval {f}")',
             ("tests/test_hostile_inputs.py::test_lora_qat_prints_the_perplexity_of_the_saved_anchor",)),
    Mutation("prepare-misnames-a-bitsandbytes-model", "mfqat/qat/prepare.py",
             "    _refuse_bnb(model)\n", "",
             ("tests/test_qlora.py::test_prepare_names_a_bitsandbytes_model_as_already_quantized",)),
    Mutation("peft-save-model-anchor-unmerged", "mfqat/integrations/hf.py",
             'save_anchor(merged_copy(base), os.path.join(output_dir', 'save_anchor(base, os.path.join(output_dir',
             ("tests/test_hf_trainer.py::test_save_model_of_a_peft_model_writes_the_merged_anchor",)),
    Mutation("report-to-compares-names-with-the-enum", "mfqat/integrations/train_setup.py",
             '    available = {str(getattr(t, "value", t)) for t in _available_trackers}',
             "    available = set(_available_trackers)",
             ("tests/test_tensorboard.py::test_report_to_tensorboard_logs_every_formats_loss_and_perplexity",)),
    Mutation("mfqat-trainer-callback-after-the-reporters", "mfqat/integrations/hf.py",
             "        cbs.insert(0, cb)  # before the reporters", "        cbs.append(cb)  # after the reporters",
             ("tests/test_tensorboard.py::test_mfqat_trainer_per_format_eval_metrics_reach_tensorboard",)),
    Mutation("plain-trainer-reporters-not-warned", "mfqat/integrations/hf.py",
             "        self._warn_reporters(args)\n", "",
             ("tests/test_tensorboard.py::test_plain_trainer_with_reporters_warns_that_per_format_metrics_miss_them",)),
    Mutation("step-file-field-the-doc-lacks", "mfqat/storage/train_checkpoint.py",
             '    meta = {"kind": KIND, "step": int(step), **(extra or {}),',
             '    meta = {"kind": KIND, "step": int(step), "written_at": 0, **(extra or {}),',
             ("tests/test_file_formats_doc.py::test_every_training_checkpoint_file_and_step_field_is_in_the_doc",)),
    Mutation("kept-quantized-weight-is-the-anchors", "mfqat/qat/modules.py",
             "[wq.to(out.dtype)] if ctx.keep", "[module.quantized_weight(module.anchor_format).to(out.dtype)] if ctx.keep",
             ("tests/test_keep_quantized.py::test_kept_weight_gives_the_recomputed_gradients_bit_for_bit",)),
]


def copy_repo(dst: Path) -> Path:
    """The working tree without .venv/.git/out/caches; the built C++ extension comes along."""
    shutil.copytree(ROOT, dst, ignore=IGNORE)
    for so in (ROOT / "mfqat").glob("_C*.so"):  # also when a pattern above ever ignores it
        if not (dst / "mfqat" / so.name).exists():
            shutil.copy2(so, dst / "mfqat" / so.name)
    return dst


def run_tests(copy: Path, tests: Tuple[str, ...], timeout: int) -> Tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1", "TRITON_INTERPRET": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("MFQAT_BACKEND", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    try:
        r = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timeout"
    lines = (r.stdout + r.stderr).strip().splitlines()
    why = next((l.strip() for l in lines if l.startswith("E ")), "")  # the first failure line, if any
    return r.returncode, (lines[-1] if lines else "") + (f"  | {why[:110]}" if why else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", default="", help="only mutations whose name contains this (a comma list: any of them)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--no-baseline", action="store_true", help="skip the run on the unmodified copy")
    p.add_argument("--timeout", type=int, default=300, help="seconds per pytest run")
    args = p.parse_args(argv)
    muts = [m for m in MUTATIONS if any(k in m.name for k in args.k.split(","))]
    if args.list:
        for m in muts:
            print(f"{m.name:40s} {m.file}  ->  {' '.join(m.tests)}")
        return 0
    t0 = time.perf_counter()
    problems: List[str] = []
    with tempfile.TemporaryDirectory(prefix="mfqat-mutants-") as tmp:
        copy = copy_repo(Path(tmp) / "repo")
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in muts for t in m.tests))
            rc, tail = run_tests(copy, tests, args.timeout * 2)
            print(f"baseline (unmodified copy, {len(tests)} test ids): {'pass' if rc == 0 else 'FAIL'}  {tail}")
            if rc != 0:
                print("the targeted tests must pass before mutating; fix them first")
                return 1
        caught = 0
        for m in muts:
            path = copy / m.file
            original = path.read_text()
            if original.count(m.old) != 1:
                problems.append(f"{m.name}: the snippet occurs {original.count(m.old)} times in {m.file} (update the spec)")
                print(f"[spec ] {m.name}: snippet not found exactly once in {m.file}")
                continue
            path.write_text(original.replace(m.old, m.new))
            try:
                t = time.perf_counter()
                rc, tail = run_tests(copy, m.tests, args.timeout)
            finally:
                path.write_text(original)
            if rc == 1:  # pytest: tests failed
                caught += 1
                verdict = "caught  "
            elif rc == 0:
                verdict = "SURVIVED"
                problems.append(f"{m.name}: survived {' '.join(m.tests)}")
            else:  # usage error, no tests collected, interrupted, timeout: not evidence of a catch
                verdict = f"ERROR {rc}"
                problems.append(f"{m.name}: pytest exit {rc} ({tail})")
            print(f"[{verdict}] {m.name:40s} {time.perf_counter() - t:5.1f}s  {tail}")
    print(f"\nmutation check: {caught}/{len(muts)} caught ({time.perf_counter() - t0:.0f}s)")
    for line in problems:
        print("  - " + line)
    return 0 if caught == len(muts) and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
