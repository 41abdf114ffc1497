"""README.md model cards for what mfqat writes (anchors, MLX exports, convert outputs), as mlx-lm's
``convert`` / ``fuse`` write one: YAML front matter (library, tags, base model) and how to use it."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from mfqat._build import __version__

USAGE = {
    "anchor": "```bash\nmfqat eval {name} --formats {formats}\nmfqat export-mlx {name} --out {name}-mlx "
              "--recipe uniform:mxint4\n```\n\n```python\nimport mfqat\nmodel = mfqat.load_anchor(\"{name}\", "
              "fmt=\"mxint4\")  # any lower format of the family, by Slice-and-Scale\n```",
    "mlx": "```bash\npip install mlx-lm\nmlx_lm.generate --model {name} --prompt \"hello\"\n"
           "mfqat generate {name} --prompt \"hello\"\n```",
    "convert": "```python\nfrom transformers import AutoModelForCausalLM\nmodel = "
               "AutoModelForCausalLM.from_pretrained(\"{name}\")\n```",
}
TITLE = {"anchor": "mfqat anchor", "mlx": "MLX export", "convert": "dequantized checkpoint"}


def model_card(kind: str, name: str, source: Optional[str] = None, formats: Optional[List[str]] = None,
               note: str = "") -> str:
    """The README.md text for an artifact of ``kind`` (anchor, mlx, convert) named ``name``."""
    tags = ["mfqat", "quantization", "microscaling"] + (["mlx"] if kind == "mlx" else [])
    front = ["---", f"library_name: {'mlx' if kind == 'mlx' else 'transformers'}", "tags:"]
    front += [f"- {t}" for t in tags]
    if source and not Path(source).exists():  # a Hub id rather than a local folder
        front.append(f"base_model: {source}")
    front.append("---")
    fmts = ",".join(formats or [])
    body = [f"# {name} ({TITLE[kind]})", "",
            f"Written by mfqat {__version__}" + (f" from `{source}`" if source else "") + ".",
            ""]
    if note:
        body += [note, ""]
    body += ["## Use", "", USAGE[kind].format(name=name, formats=fmts or "mxint8,mxint4"), ""]
    return "\n".join(front + [""] + body)


def write_model_card(folder: Path, kind: str, source: Optional[str] = None, formats: Optional[List[str]] = None,
                     note: str = "", name: Optional[str] = None) -> None:
    """Write README.md into ``folder`` (a temporary output folder: name it with ``name``)."""
    Path(folder, "README.md").write_text(model_card(kind, name or Path(folder).name, source, formats, note))
