import os

import torch
from hypothesis import HealthCheck, settings

# scikit-learn sets these two in os.environ when it is first imported (for Intel's OpenMP; torch's CPU wheel
# uses GNU's), and the digits data (examples/digits.py) imports it in the middle of the run. The warm rank
# servers (tests/_zygote.py) serve only ranks whose start-up variables are theirs, so that change restarted them
# in each pytest worker. Set first, as scikit-learn sets them, they change nothing later.
for _name, _value in (("KMP_DUPLICATE_LIB_OK", "True"), ("KMP_INIT_AT_FORK", "FALSE")):
    os.environ.setdefault(_name, _value)

settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=10000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Each pytest worker (make test runs two) takes its share of the cores for torch's own threads: a worker's ops
# spread over every core contend with the other worker's, which runs a job's ranks on them meanwhile.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
