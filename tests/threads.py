"""Intra-op threads of the in-process tests: one by default (tiny models are overhead-bound, and the tiers run one
pytest worker per core); ``DARE_TEST_THREADS=2`` reruns a test at two, e.g. the bit-for-bit and batch-invariance
tests, whose results must not depend on it."""
import os

TEST_THREADS = int(os.environ.get("DARE_TEST_THREADS", "1"))
