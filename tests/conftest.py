"""Suite-wide test settings.

Hypothesis runs derandomized by default so that CI is deterministic: the same examples
every run. Set MESHNODE_HYPOTHESIS=explore to search with fresh randomness (and more
examples) when hunting for new counterexamples locally.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", derandomize=False, deadline=None, max_examples=2000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("explore" if os.environ.get("MESHNODE_HYPOTHESIS") == "explore" else "ci")
