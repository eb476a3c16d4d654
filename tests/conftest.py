import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
# The benchmarks' measuring helpers (peak memory) serve the tests too.
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
os.environ.setdefault("PL_DISABLE_FORK", "0")

# DDP's constructor imports torch._dynamo lazily (about a second); importing it once here means
# every forked rank inherits it instead of paying for it again.
import torch._dynamo  # noqa: F401
