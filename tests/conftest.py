import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

MX_FORMATS = ["mxint8", "mxint7", "mxint6", "mxint5", "mxint4", "mxint3", "mxint2",
              "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1"]
MXFP_FORMATS = [f for f in MX_FORMATS if f.startswith("mxfp")]


@pytest.fixture(params=MX_FORMATS)
def mx_format(request):
    return request.param
