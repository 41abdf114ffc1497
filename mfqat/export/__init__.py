"""MLX export: bit-exact mixed-bit models that mlx_lm loads and serves."""
from mfqat.export.mlx_export import to_mlx
from mfqat.export.recipes import Plan, build_plan

__all__ = ["to_mlx", "build_plan", "Plan"]
