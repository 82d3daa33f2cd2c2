"""Test-wide settings: hypothesis profiles and the inductor cache.

`ci` (the default) is bounded and derandomized, so the property suite is fast
and the same on every run. Hunt for bugs locally with
`HYPOTHESIS_PROFILE=hunt pytest property_tests`.
"""

import os

import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), ".cache", "inductor")
)
torch.set_num_threads(1)

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=2000,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("hunt", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The torchrun workers are scripts launched by path (their own folder first on sys.path), not modules:
# `--doctest-modules` would import them as `tests.<name>`, where their sibling imports do not resolve.
collect_ignore_glob = ["tests/*_worker.py"]
