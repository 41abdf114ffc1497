"""Evaluation: perplexity, elastic (multi-format) evaluation, tables and plots."""
from mfqat.eval.perplexity import elastic_perplexity, mean_nll, perplexity
from mfqat.eval.report import format_table, plot_curve, plot_ppl_vs_bpw

__all__ = ["perplexity", "mean_nll", "elastic_perplexity", "format_table", "plot_ppl_vs_bpw", "plot_curve"]
